"""What a grammar may cost (``oneblock.inference.grammar_bounds``): grammars that would overflow llguidance's
compiler stack, or pass its limits only on the first token, are refused by name before compiling; a grammar with
no sentence is refused as unsatisfiable; the compile thread's stack holds what the bounds let through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oneblock.errors import InputError
from oneblock.inference import grammar_bounds

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")

from oneblock.inference.constraints import Constraint

SRC = str(Path(__file__).resolve().parents[2] / "src")


def tokenizer():
    """A byte-level BPE of 300 tokens trained here; id 0 ends an answer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(['{"name": "a", "kids": []}'] * 10, trainer)
    return tok


def chained_rules(n: int) -> str:
    """A Lark grammar of ``n`` rules, each referring to the next: about 17 bytes a rule."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(n)) + f'r{n}: "b"\n'


def nested_refs(n: int) -> dict:
    """A JSON schema whose ``$defs`` refer to each other ``n`` deep."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def branches(n: int) -> dict:
    """A JSON schema of ``n`` objects in an ``anyOf``: llguidance fails after ``{"`` past 2,000."""
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                      for i in range(n)]}  # fmt: skip


TOK = tokenizer()


def compiles(build) -> bool:
    """Whether the constraint compiles and its first mask allows a token."""
    return bool(build().start().allowed(300).any())


def test_grammars_past_the_bounds_are_refused_by_name_and_the_library_keeps_working():
    with pytest.raises(InputError, match=r"the Lark grammar has 6,002 rules; the limit is 2,000") as caught:
        Constraint.lark(TOK, chained_rules(6000), eos_ids=[0])  # about 100 KB
    assert len(str(caught.value)) < 200
    with pytest.raises(InputError, match=r"nests \$ref references 1,501 deep; the limit is 256") as caught:
        Constraint.json_schema(TOK, nested_refs(1500), eos_ids=[0])  # about 110 KB
    assert len(str(caught.value)) < 200
    with pytest.raises(InputError, match=r"an anyOf of 2,100 branches; the limit is 1,000") as caught:
        Constraint.json_schema(TOK, branches(2100), eos_ids=[0])
    assert len(str(caught.value)) < 200
    with pytest.raises(InputError, match=r"the Lark grammar is 600,0\d\d bytes; the limit is 512,000 bytes"):
        Constraint.lark(TOK, 'start: "' + "a" * 600_000 + '"', eos_ids=[0])
    inline = f"start: obj\nobj: %json {nested_refs(300)!s}".replace("'", '"')  # a schema inside a Lark grammar
    with pytest.raises(InputError, match=r"nests \$ref references 301 deep"):
        Constraint.lark(TOK, inline, eos_ids=[0])
    # within the bounds, the same shapes compile, and recursion (a tree) is not a chain
    assert compiles(lambda: Constraint.lark(TOK, chained_rules(1990), eos_ids=[0]))
    assert compiles(lambda: Constraint.json_schema(TOK, nested_refs(250), eos_ids=[0]))
    assert compiles(lambda: Constraint.json_schema(TOK, branches(900), eos_ids=[0]))
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert grammar_bounds.ref_depth(tree) == (1, 0)  # one reference, back to the root
    assert compiles(lambda: Constraint.json_schema(TOK, tree, eos_ids=[0]))


def test_the_compile_thread_holds_a_grammar_that_overflows_an_ordinary_stack():
    """Without the bounds, 6,000 chained rules and 1,500 nested references overflow an 8 MB stack (the process
    dies with SIGSEGV); on the compile thread's stack they compile. Run in a process of its own, so that a failure
    is a return code, not the end of the test run."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
        "from oneblock.inference import grammar_bounds as gb\n"
        "import test_grammar_bounds as t\n"
        "gb.MAX_RULES = gb.MAX_REF_DEPTH = 10**6\n"
        "from oneblock.inference.constraints import Constraint\n"
        "print(t.compiles(lambda: Constraint.lark(t.TOK, t.chained_rules(6000), eos_ids=[0])),\n"
        "      t.compiles(lambda: Constraint.json_schema(t.TOK, t.nested_refs(1500), eos_ids=[0])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, SRC, str(Path(__file__).parent)], capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stdout.strip()) == (0, "True True"), done.stderr[-2000:]


@pytest.mark.parametrize(
    "build",
    [
        lambda: Constraint.lark(TOK, 'start: start "a"', eos_ids=[0]),
        lambda: Constraint.json_schema(TOK, {"$ref": "#"}, eos_ids=[0]),
        lambda: Constraint.json_schema(TOK, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                                             "b": {"$ref": "#/$defs/a"}}}, eos_ids=[0]),
    ],
)  # fmt: skip
def test_a_grammar_without_a_sentence_is_refused_as_unsatisfiable(build):
    with pytest.raises(InputError, match=r"is unsatisfiable: no text is a sentence of it"):
        build()
    assert compiles(lambda: Constraint.lark(TOK, 'start: "a"', eos_ids=[0]))
