"""`deltafuse train` loses no run: a directory holding a run is never written into by another one, --overwrite
replaces a run only once the new one has finished (put back on failure or Ctrl-C), and every refused call
leaves the earlier run's files byte for byte as they were, before anything heavy is built."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from deltafuse.train import outdir, setup
from deltafuse.train import progress as progress_mod
from deltafuse.train.cli import main

TINY = ["--seq-len", "128", "--num-examples", "10", "--no-progress", "--no-deltafuse", "--save-every", "1"]


def snapshot(root) -> dict[str, str]:
    """Every file under ``root`` (hidden ones included) -> sha256 of its bytes; directories -> 'dir'."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> str:
    """A finished 2-step LoRA run: checkpoint-1, checkpoint-2, final, metrics.jsonl, summary.json, train_args."""
    out = str(tmp_path_factory.mktemp("finished") / "run")
    assert main(["--output-dir", out, "--max-steps", "2", *TINY]) == 0
    assert {"checkpoint-1", "checkpoint-2", *outdir.ARTIFACTS} <= set(os.listdir(out))
    return out


@pytest.fixture
def run_b(tmp_path, finished_run):
    """A copy of the finished run with a user's file beside it, and its snapshot."""
    b = str(tmp_path / "B")
    shutil.copytree(finished_run, b)
    with open(os.path.join(b, "notes.txt"), "w") as fh:
        fh.write("mine")
    return b, snapshot(b)


@pytest.fixture
def no_model_build(monkeypatch):
    """A refused call must not get as far as building the model."""
    def refuse(*a, **k):
        raise AssertionError("the model was built before the input was refused")

    monkeypatch.setattr(setup, "load_model_and_tokenizer", refuse)


def refused(argv, capsys, *needles) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("deltafuse train: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A tiny Llama model directory: a family deltafuse does not patch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from deltafuse.train.tokenizer import build_byte_tokenizer

    d = str(tmp_path_factory.mktemp("llama"))
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=300)
    LlamaForCausalLM(cfg).save_pretrained(d)
    build_byte_tokenizer().save_pretrained(d)
    return d


# --- refused before anything is built or moved -------------------------------------------------------
def test_resume_from_another_run_into_a_finished_run_is_refused(run_b, finished_run, tmp_path, capsys,
                                                                no_model_build):
    b, before = run_b
    a = str(tmp_path / "A")
    shutil.copytree(finished_run, a)
    refused(["--output-dir", b, "--resume", os.path.join(a, "checkpoint-1"), "--max-steps", "3", *TINY], capsys,
            f"--output-dir {b!r} holds another run (checkpoint-1, checkpoint-2, final, metrics.jsonl, ...)",
            "would mix the two runs", "--overwrite")
    assert snapshot(b) == before


def test_overwrite_with_bad_input_keeps_the_previous_run(run_b, tmp_path, llama_dir, capsys, no_model_build):
    b, before = run_b
    base = ["--output-dir", b, "--overwrite", "--max-steps", "2", "--seq-len", "128", "--no-progress"]
    refused(base + ["--data", str(tmp_path / "typo.jsonl")], capsys, "typo.jsonl': no such file")
    refused(base + ["--model", "tinyy"], capsys, "--model 'tinyy' is neither a known model name")
    refused(base + ["--model", llama_dir], capsys, f"--model {llama_dir!r} is a 'llama' model",
            "qwen3_5_text", "--no-deltafuse")
    refused(base + ["--lr", "1e-3", "--resume", os.path.join(b, "checkpoint-1")], capsys,
            "is a checkpoint of --output-dir", "--overwrite would replace")
    assert snapshot(b) == before


def test_unsupported_model_family_is_one_line(llama_dir, tmp_path, capsys, no_model_build):
    out = str(tmp_path / "out")
    refused(["--model", llama_dir, "--output-dir", out, "--deltafuse"], capsys,
            f"--model {llama_dir!r} is a 'llama' model, a family deltafuse does not patch", "qwen3_next")
    with open(os.path.join(llama_dir, "config.json")) as fh:
        cfg = json.load(fh)
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "model_type"}))
    refused(["--model", str(bad), "--output-dir", out], capsys, "config.json has no model_type")
    (bad / "config.json").write_text('{"model_type": ')
    refused(["--model", str(bad), "--output-dir", out], capsys, "config.json cannot be read as JSON")
    shutil.copy(os.path.join(llama_dir, "config.json"), bad / "config.json")
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:200])
    refused(["--model", str(bad), "--output-dir", out, "--no-deltafuse"], capsys,
            "model.safetensors cannot be read as safetensors")
    assert not os.path.exists(out)


def _unwritable_dir(tmp_path) -> str:
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        return str(d / "out")
    try:  # root writes through permission bits; sysfs refuses new files even to root
        open("/sys/.deltafuse-probe", "w").close()
    except OSError:
        return "/sys/deltafuse-out"
    pytest.skip("no directory here refuses root")


def test_unwritable_or_file_output_dir_is_refused_before_the_model_is_built(tmp_path, capsys, no_model_build):
    path = _unwritable_dir(tmp_path)
    refused(["--output-dir", path], capsys, f"--output-dir {path!r} is not writable", "refuses new files")
    f = tmp_path / "file"
    f.write_text("x")
    refused(["--output-dir", str(f)], capsys, f"--output-dir {str(f)!r} is a file")
    refused(["--output-dir", str(f / "sub")], capsys, "cannot be created", f"{str(f)!r} is a file")
    assert f.read_text() == "x"


@pytest.mark.parametrize("damage, needles", [
    ("truncated_state", ("trainer_state.json is not valid JSON", "line ", "earlier checkpoint-N")),
    ("step_not_int", ("trainer_state.json has no integer global_step (found '2')",)),
    ("no_adapter", ("has no adapter weights (adapter_model.safetensors or adapter_model.bin)",)),
    ("truncated_adapter", ("adapter_model.safetensors cannot be read as safetensors",)),
    ("no_optimizer", ("has no optimizer state (optimizer.pt)",)),
    ("no_scheduler", ("has no learning-rate scheduler state (scheduler.pt)",)),
    ("full", ("holds LoRA adapter weights (adapter_model.safetensors), not a full model", "without --full")),
])
def test_damaged_checkpoint_is_refused_and_the_run_kept(run_b, capsys, no_model_build, damage, needles):
    b, _ = run_b
    ckpt = os.path.join(b, "checkpoint-2")
    state = os.path.join(ckpt, "trainer_state.json")
    extra = []
    if damage == "truncated_state":
        with open(state, "rb") as fh:
            head = fh.read(40)
        with open(state, "wb") as fh:
            fh.write(head)
    elif damage == "step_not_int":
        with open(state) as fh:
            st = json.load(fh)
        st["global_step"] = "2"
        with open(state, "w") as fh:
            json.dump(st, fh)
    elif damage == "no_adapter":
        os.remove(os.path.join(ckpt, "adapter_model.safetensors"))
    elif damage == "truncated_adapter":
        with open(os.path.join(ckpt, "adapter_model.safetensors"), "r+b") as fh:
            fh.truncate(300)
    elif damage == "no_optimizer":
        os.remove(os.path.join(ckpt, "optimizer.pt"))
    elif damage == "no_scheduler":
        os.remove(os.path.join(ckpt, "scheduler.pt"))
    elif damage == "full":
        extra = ["--full"]
    # a state that does not parse (or has no integer step) is a save cut off, which --resume latest skips for the
    # checkpoint before it (test_interrupt): named explicitly, the checkpoint is refused
    resume = [ckpt] if damage in ("truncated_state", "step_not_int") else []
    before = snapshot(b)
    line = refused(["--output-dir", b, "--resume", *resume, "--max-steps", "4", *TINY, *extra], capsys,
                   f"--resume {ckpt!r}", *needles)
    assert "Traceback" not in line
    assert snapshot(b) == before  # metrics.jsonl included: nothing is truncated for a refused resume


def test_left_over_set_aside_run_is_reported_not_deleted(run_b, capsys, no_model_build):
    b, _ = run_b
    aside = os.path.join(b, outdir.ASIDE)
    os.mkdir(aside)
    with open(os.path.join(aside, "metrics.jsonl"), "w") as fh:
        fh.write('{"step": 7}\n')
    before = snapshot(b)
    refused(["--output-dir", b, "--overwrite", *TINY], capsys, f"holds {aside!r}", "interrupted --overwrite",
            "move its contents back")
    assert snapshot(b) == before


# --- runs that write --------------------------------------------------------------------------------
def test_resume_from_another_run_continues_it_exactly(finished_run, run_b, tmp_path, capsys):
    """Into a new directory, and with --overwrite into one holding a run: the checkpoint's history up to
    its step, then the new steps, which equal the original run's (the same run continued)."""
    original, source_before = records(finished_run), snapshot(finished_run)
    new = str(tmp_path / "new")
    assert main(["--output-dir", new, "--resume", os.path.join(finished_run, "checkpoint-1"), "--max-steps", "2",
                 *TINY]) == 0
    got = records(new)
    assert [r["step"] for r in got] == [1, 2] and got[0] == original[0]
    assert abs(got[1]["loss"] - original[1]["loss"]) < 1e-5, (got[1], original[1])
    assert snapshot(finished_run) == source_before  # the source run is only read

    b, before = run_b
    with open(os.path.join(b, "metrics.jsonl"), "w") as fh:  # mark B's run, so a splice would show
        fh.writelines(json.dumps({**r, "loss": 100.0 + r["step"]}) + "\n" for r in original)
    assert main(["--output-dir", b, "--overwrite", "--resume", os.path.join(new, "checkpoint-2"), "--max-steps",
                 "3", *TINY]) == 0
    got_b = records(b)
    assert [r["step"] for r in got_b] == [1, 2, 3]
    assert got_b[:2] == got and all(r["loss"] < 100 for r in got_b)
    assert not os.path.exists(os.path.join(b, outdir.ASIDE))
    assert open(os.path.join(b, "notes.txt")).read() == "mine"
    assert sorted(n for n in os.listdir(b) if n.startswith("checkpoint-")) == ["checkpoint-3"]  # B's old ones gone
    assert snapshot(b)["final/adapter_model.safetensors"] != before["final/adapter_model.safetensors"]


def test_resume_in_place_from_an_earlier_checkpoint_keeps_history_up_to_it(run_b, finished_run, capsys):
    b, _ = run_b
    original = records(finished_run)
    assert main(["--output-dir", b, "--resume", os.path.join(b, "checkpoint-1"), "--max-steps", "2", *TINY]) == 0
    got = records(b)
    assert [r["step"] for r in got] == [1, 2] and got[0] == original[0]
    assert abs(got[1]["loss"] - original[1]["loss"]) < 1e-5


def _interrupt_at_save(monkeypatch, step: int, exc=KeyboardInterrupt):
    """Raise ``exc`` from a callback right after checkpoint-``step`` is saved (Ctrl-C at the worst moment)."""
    make = progress_mod.make_step_logger

    def make_interrupting():
        base = make()

        class Interrupting(base):
            def on_save(self, args, state, control, **kw):
                if state.global_step == step:
                    raise exc()

        return Interrupting

    monkeypatch.setattr(progress_mod, "make_step_logger", make_interrupting)


def test_ctrl_c_during_overwrite_puts_the_previous_run_back(run_b, monkeypatch, capsys):
    b, before = run_b
    _interrupt_at_save(monkeypatch, 2)
    rc = main(["--output-dir", b, "--overwrite", "--max-steps", "3", "--seed", "5", *TINY])
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err
    assert err.strip() == (f"deltafuse train: interrupted; the previous run in {b!r} is restored as it was; this "
                           "run's partial output was removed")
    assert snapshot(b) == before


def test_failure_during_overwrite_puts_the_previous_run_back(run_b, monkeypatch):
    b, before = run_b
    _interrupt_at_save(monkeypatch, 1, exc=lambda: RuntimeError("disk full"))
    with pytest.raises(RuntimeError, match="disk full"):
        main(["--output-dir", b, "--overwrite", "--max-steps", "3", *TINY])
    assert snapshot(b) == before


def test_overwrite_that_finishes_replaces_the_run_and_keeps_other_files(run_b, capsys):
    b, before = run_b
    assert main(["--output-dir", b, "--overwrite", "--max-steps", "1", "--seed", "3", *TINY]) == 0
    assert "the previous run in " + b + " (6 entries) is set aside until this one finishes" in capsys.readouterr().out
    assert sorted(os.listdir(b)) == ["checkpoint-1", "final", "metrics.jsonl", "notes.txt", "summary.json",
                                     "train_args.json"]
    assert [r["step"] for r in records(b)] == [1]
    assert snapshot(b)["checkpoint-1/adapter_model.safetensors"] != before["checkpoint-1/adapter_model.safetensors"]


def test_ctrl_c_in_a_new_run_keeps_its_checkpoints_and_resume_continues(tmp_path, monkeypatch, capsys,
                                                                       finished_run):
    out = str(tmp_path / "new")
    with monkeypatch.context() as m:
        _interrupt_at_save(m, 1)
        rc = main(["--output-dir", out, "--max-steps", "2", *TINY])
    err = capsys.readouterr().err
    assert rc == 130
    ckpt = os.path.join(out, "checkpoint-1")
    assert err.strip() == (f"deltafuse train: interrupted; checkpoints so far are in {out!r} (latest {ckpt}); "
                           f"continue with: deltafuse train ... --output-dir {out} --resume latest")
    assert main(["--output-dir", out, "--resume", "--max-steps", "2", *TINY]) == 0
    got, original = records(out), records(finished_run)
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(got, original):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)


@pytest.mark.parametrize("text, reason", [("[]", "not a JSON object"), ("{", "Expecting property name")])
def test_resume_from_a_run_whose_settings_cannot_be_read_is_one_line(tmp_path, text, reason):
    import argparse

    from deltafuse.train.errors import TrainInputError

    (tmp_path / "train_args.json").write_text(text)
    plan = outdir.OutputPlan(str(tmp_path), resume_from="checkpoint-1", resume_step=1, source_run=str(tmp_path))
    with pytest.raises(TrainInputError, match=r"^--resume 'checkpoint-1': .*train_args.json \(the settings of its "
                                              rf"run\) cannot be read \({reason}"):
        outdir.check_resume_compatible(argparse.Namespace(max_steps=5), plan)
