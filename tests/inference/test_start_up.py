"""The garbage collector held off during start-up: in ``load_model``, and in a fresh ``oneblock generate`` process
from before ``import torch`` until the model is loaded, after which start-up's objects are frozen and the
collector runs again; a process that had imported torch already (a test, a notebook) is left as it is."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import torch

from oneblock.inference import process
from oneblock.inference.load import load_model


def test_collector_paused_restores_the_state_it_found():
    assert gc.isenabled()
    with process.collector_paused():
        assert not gc.isenabled()
        with process.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off, and leaves it off
    assert gc.isenabled()
    gc.disable()
    try:
        with process.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_load_model_loads_with_the_collector_off(monkeypatch):
    seen = []
    real = torch.manual_seed

    def seed(value):
        seen.append(gc.isenabled())
        return real(value)

    monkeypatch.setattr(torch, "manual_seed", seed)  # the preset's load seeds its initialization
    loaded = load_model("lesson", seed=3)
    assert seen == [False] and gc.isenabled()
    torch.manual_seed(3)
    from oneblock.models import build_model
    from oneblock.presets import get_preset

    reference = build_model(get_preset("lesson"))
    for (name, a), (_, b) in zip(loaded.model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the same model as built with the collector on


def test_pause_and_start_up_done_touch_only_what_they_paused():
    frozen = gc.get_freeze_count()
    process.start_up_done()  # nothing was paused: nothing happens
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    process.pause_for_start_up()
    assert not gc.isenabled()
    process.start_up_done(freeze=False)
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()
    try:
        process.pause_for_start_up()  # already off (by someone else): not ours to turn on again
        process.start_up_done()
        assert not gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.enable()


_FRESH = """
import gc, json, sys
from oneblock.inference import process
events = []
gc.callbacks.append(lambda phase, info: phase == "start" and events.append("collect"))
done = process.start_up_done
def marked(**options):
    events.append("loaded:" + str("torch" in sys.modules))
    done(**options)
process.start_up_done = marked
from oneblock.cli.main import main
events.append("main")
code = main(sys.argv[1:])
print(json.dumps({"code": code, "events": events, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


def test_a_fresh_generate_process_collects_nothing_until_its_model_is_loaded():
    argv = ["generate", "--model", "lesson", "--prompt", "ab", "--max-new-tokens", "2", "--greedy", "--no-echo"]
    out = subprocess.run([sys.executable, "-c", _FRESH, *argv], capture_output=True, text=True, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["code"] == 0 and report["enabled"] and report["frozen"] > 10_000
    events = report["events"]
    start, loaded = events.index("main"), events.index("loaded:True")
    assert start < loaded and "collect" not in events[start:loaded]  # not during import torch, nor the load


def test_a_command_that_does_not_say_when_it_is_loaded_gets_the_collector_back_at_once():
    code = (
        "import gc, sys\n"
        "from oneblock.cli import count\n"
        "seen = []\n"
        "real = count.run\n"
        "count.run = lambda args: seen.append(gc.isenabled()) or real(args)\n"
        "from oneblock.cli.main import main\n"
        "main(['count', '--model', 'lesson'])\n"
        "print(seen, gc.isenabled(), gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[True] True 0"


def test_a_command_run_in_a_process_that_imported_torch_leaves_the_collector_alone():
    from oneblock.cli.main import main

    frozen = gc.get_freeze_count()
    assert main(["generate", "--model", "lesson", "--prompt", "ab", "--max-new-tokens", "1", "--no-echo"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen
