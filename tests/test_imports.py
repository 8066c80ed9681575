"""Start-up: ``import oneblock`` and ``oneblock --help`` import only what they need (counted, not timed)."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "transformers", "tokenizers", "gguf", "safetensors", "matplotlib", "rich")


def imported_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint('\\nMODULES', ' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    line = done.stdout.rsplit("\nMODULES ", 1)[-1]  # the modules, not a help text that names torch
    return set(line.split())


@pytest.mark.parametrize(
    "code",
    [
        "import oneblock",
        "import oneblock as ob; ob.ModelConfig(); ob.get_preset('gpt2')",
        "from oneblock.cli.main import main; main(['--help'])",
        "from oneblock.cli.main import main; main(['generate', '--help'])",
    ],
)
def test_start_up_imports_no_heavy_package(code):
    assert imported_after(code).isdisjoint(HEAVY)


def test_public_names_still_resolve():
    import oneblock as ob

    for name in ob.__all__:
        assert getattr(ob, name) is not None, name
    assert ob.generate.__module__ == "oneblock.inference.generation"
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        ob.nope  # noqa: B018
