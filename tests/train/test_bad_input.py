"""Every bad input of `deltafuse train` gets one clear line (argument, value, what is allowed), exit code 2,
no traceback, and nothing is lost."""

from __future__ import annotations

import json
import os

import pytest

from deltafuse.train.cli import main


def fails(argv, capsys, *needles):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("deltafuse train: error: ")]
    assert line, err
    for needle in needles:
        assert needle in line[-1], (needle, line[-1])
    return line[-1]


@pytest.fixture
def out(tmp_path):
    return str(tmp_path / "out")


def test_unknown_model_name_lists_the_known_ones(capsys, out):
    fails(["--model", "tiny-moe2", "--output-dir", out], capsys,
          "--model 'tiny-moe2' is neither a known model name nor a directory",
          "known names: tiny, tiny-moe, tiny-next, dense8, moe8, dense, moe")
    fails(["--model", "./models/nowhere", "--output-dir", out], capsys, "is not a directory that exists")


def test_model_directory_without_weights_or_tokenizer(tmp_path, capsys, out):
    d = tmp_path / "m"
    d.mkdir()
    fails(["--model", str(d), "--output-dir", out], capsys, "has no config.json")
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"x")
    fails(["--model", str(d), "--output-dir", out], capsys, "has no *.safetensors weights",
          "found pytorch_model.bin; only safetensors are loaded")
    (d / "model.safetensors").write_bytes(b"x")
    fails(["--model", str(d), "--output-dir", out], capsys, "has no tokenizer", "tokenizer.json")
    assert not os.path.exists(out)  # nothing was created for a run that could not start


def test_data_file_problems(tmp_path, capsys, out):
    fails(["--data", str(tmp_path / "missing.jsonl"), "--output-dir", out], capsys, "missing.jsonl': no such file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails(["--data", str(empty), "--output-dir", out], capsys, "is empty: no JSONL rows")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{oops\n")
    fails(["--data", str(bad), "--output-dir", out], capsys, "line 2: not valid JSON", "--skip-bad-rows")


def test_skip_bad_rows_trains_and_counts_them(tmp_path, capsys, out):
    rows = [json.dumps({"prompt": f"{i} + {i} = ", "completion": f"{2 * i}"}) for i in range(12)]
    rows[4] = '{"prompt": 1}'
    rows[7] = "not json"
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(rows) + "\n")
    assert main(["--data", str(path), "--skip-bad-rows", "--max-steps", "2", "--seq-len", "64",
                 "--output-dir", out, "--no-progress", "--no-deltafuse"]) == 0
    text = capsys.readouterr().out
    assert "skipped 2 bad row(s) (--skip-bad-rows), lines 5, 8" in text
    with open(os.path.join(out, "summary.json")) as fh:
        s = json.load(fh)
    assert s["data"]["bad_rows_skipped"] == 2 and s["data"]["examples"] == 10


def test_rows_longer_than_seq_len_are_truncated_and_counted(tmp_path, capsys, out):
    path = tmp_path / "long.jsonl"
    # chat-template overhead is 21 tokens: 46 tokens fit; 71 are cut inside the completion; 91 are cut before it
    path.write_text("\n".join(json.dumps({"prompt": "q" * n, "completion": "a" * 20}) for n in (5, 30, 50)) + "\n")
    assert main(["--data", str(path), "--max-steps", "1", "--seq-len", "64", "--output-dir", out,
                 "--no-progress", "--no-deltafuse"]) == 0
    text = capsys.readouterr().out
    assert "truncated 2 row(s) longer than --seq-len 64 tokens" in text
    assert "dropped 1 row(s) with no completion token within --seq-len 64" in text


def test_existing_output_dir_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    line = fails(["--output-dir", str(out)], capsys, "exists and is not empty (precious.txt)", "--overwrite")
    assert "--resume" not in line  # nothing there to resume
    assert (out / "precious.txt").read_text() == "keep me"
    fails(["--output-dir", str(out), "--resume"], capsys, "has no checkpoint-N folder to resume from")
    fails(["--output-dir", str(out), "--resume", "--overwrite"], capsys, "contradict")
    fails(["--output-dir", str(out), "--resume", str(out)], capsys, "is not a checkpoint directory")
    (tmp_path / "file").write_text("x")
    fails(["--output-dir", str(tmp_path / "file")], capsys, "is a file")


def test_overwrite_replaces_only_a_previous_run(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "checkpoint-99").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 99}\n')
    assert main(["--output-dir", str(out), "--overwrite", "--max-steps", "1", "--seq-len", "256",
                 "--num-examples", "10", "--no-progress", "--no-deltafuse"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "checkpoint-99").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_lora_options_that_do_not_fit_the_model(capsys, out):
    fails(["--lora-targets", "q_proj,qkv_proj", "--output-dir", out], capsys,
          "--lora-targets q_proj,qkv_proj: qkv_proj match no linear layer", "in_proj_qkv")
    fails(["--lora-experts", "--output-dir", out], capsys, "--lora-experts", "not a mixture-of-experts model")


def test_deltafuse_flag_against_env_master_switch(monkeypatch, capsys, out):
    monkeypatch.setenv("DELTAFUSE_PATCH", "0")
    fails(["--deltafuse", "--output-dir", out], capsys, "--deltafuse contradicts DELTAFUSE_PATCH")
    monkeypatch.setenv("DELTAFUSE_PATCH", "maybe")
    rc = main(["--output-dir", out])
    err = capsys.readouterr().err
    assert rc == 2 and "DELTAFUSE_PATCH='maybe'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--max-steps", "0"], "argument --max-steps: 0 is too small; allowed: an integer >= 1"),
    (["--seq-len", "abc"], "argument --seq-len: 'abc' is not an integer; allowed: an integer >= 2"),
    (["--lr", "-1"], "argument --lr: '-1' is not allowed; allowed: a finite number > 0"),
    (["--batch-size", "0"], "argument --batch-size: 0 is too small"),
    (["--log-every", "0"], "argument --log-every: 0 is too small"),
    (["--lora-dropout", "1.5"], "argument --lora-dropout: '1.5' is not allowed; allowed: 0 <= p < 1"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--lora", "--full"], "argument --full: not allowed with argument --lora"),
    (["--save-minutes", "-1"],
     "argument --save-minutes: '-1' is not allowed; allowed: a finite number of minutes >= 0 (0: off)"),
    (["--compile-ahead", "soon"],
     "argument --compile-ahead: 'soon' is not allowed; allowed: auto, off, or a number of threads >= 1"),
    (["--compile-ahead", "-2"],
     "argument --compile-ahead: -2 is not allowed; allowed: auto, off, or a number of threads >= 1"),
    (["--save-minutes", "soon"],
     "argument --save-minutes: 'soon' is not a number; allowed: a finite number of minutes >= 0 (0: off)"),
])
def test_bad_flag_values_name_the_argument(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_top_level_cli_wires_train(tmp_path, capsys):
    from deltafuse.cli import main as deltafuse_main

    rc = deltafuse_main(["train", "--model", "nope", "--output-dir", str(tmp_path / "o")])
    assert rc == 2 and "known names: tiny" in capsys.readouterr().err
