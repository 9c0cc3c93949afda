"""Sizes a new user can give `deltafuse train` without it eating the machine: a --seq-len far beyond the data
allocates rows as wide as the data (not as --seq-len), a value no row can have is one line before the model is
built, and a 20 MB JSONL line is streamed and truncated at tokenisation (memory bounded by what --seq-len keeps).

The subprocess runs get an address-space budget for their data (RLIMIT_DATA): before these fixes a huge
--seq-len built a 16 GiB packing index and 8 GiB per padded tensor, and a 20 MB line held ~6 GiB of token
lists; under the budget those fail quickly instead of swapping the machine out.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest

from deltafuse.train import data, gsm, packing
from deltafuse.train.tokenizer import build_byte_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_BUDGET = 4 << 30  # bytes of private writable memory a tiny run may map (it peaks well under 1 GiB)
# the child reports its own peak RSS, the high-water mark of its address space since exec (VmHWM): RUSAGE_CHILDREN
# would include every earlier child of the test process, and RUSAGE_SELF's ru_maxrss keeps the forking pytest
# process's peak across exec (1.5 GiB late in a full test run)
WRAPPER = ("import runpy, sys\n"
           "try:\n"
           "    runpy.run_module('deltafuse', run_name='__main__', alter_sys=True)\n"
           "finally:\n"
           "    hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
           "    print('peak-rss-kib', hwm[0], file=sys.stderr)\n")


def run_cli(argv, timeout=600):
    def budget():
        resource.setrlimit(resource.RLIMIT_DATA, (DATA_BUDGET, DATA_BUDGET))

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, "train", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=budget)
    elapsed = time.perf_counter() - t0
    peak = [int(line.split()[1]) * 1024 for line in proc.stderr.splitlines() if line.startswith("peak-rss-kib ")]
    return proc, elapsed, (peak[-1] if peak else None)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


# --- item 5: --seq-len far beyond the data ----------------------------------------------------------
def test_a_huge_seq_len_packs_as_the_data_needs(tok):
    examples = data.encode_rows(tok, gsm.generate(40, seed=1), 10**9, data.DataStats())
    total = sum(len(e["input_ids"]) for e in examples)
    t0 = time.perf_counter()
    bins = packing.pack(examples, 999_999_999)
    assert time.perf_counter() - t0 < 5
    assert bins == packing.pack(examples, total) and len(bins) == 1  # everything fits one bin, packed the same
    dataset, collator = packing.build_dataset(examples, 999_999_999, True, tok.pad_token_id)
    assert collator.row_tokens == total  # the row is as wide as its tokens, not --seq-len
    assert collator([dataset[0]])["input_ids"].shape == (1, total)


def test_rows_are_filled_to_the_fullest_bin_not_to_seq_len(tok):
    examples = [{"input_ids": [5] * n, "labels": [5] * n} for n in [100] * 7 + [90, 30]]
    dataset, collator = packing.build_dataset(examples, 250, True, tok.pad_token_id)
    fill = sorted(sum(len(e["input_ids"]) for e in b) for b in dataset.items)
    assert fill == [190, 200, 200, 230] and collator.row_tokens == 230  # not 250: no bin reaches it
    widths = {collator([dataset[i]])["input_ids"].shape[1] for i in range(len(dataset))}
    assert widths == {230}  # one shape for every step
    assert collator([dataset[0], dataset[1]])["input_ids"].shape == (1, 460)


def test_seq_len_999999999_runs_in_bounded_memory(tmp_path):
    proc, elapsed, peak = run_cli(["--model", "tiny", "--seq-len", "999999999", "--max-steps", "1",
                                   "--num-examples", "20", "--no-progress", "--no-deltafuse",
                                   "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert peak is not None and peak < 1.5 * (1 << 30), f"peak RSS {peak / 2**20:.0f} MiB"
    with open(tmp_path / "run" / "summary.json") as fh:
        s = json.load(fh)
    assert s["seq_len"] == 999_999_999 and s["data"]["truncated"] == 0


def test_a_seq_len_no_row_can_have_is_one_line_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    from deltafuse.train import setup
    from deltafuse.train.cli import main

    def refuse(*a, **k):
        raise AssertionError("the model was built before --seq-len was refused")

    monkeypatch.setattr(setup, "load_model_and_tokenizer", refuse)
    out = tmp_path / "out"
    assert main(["--seq-len", str(2**31), "--num-examples", "10", "--no-progress", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"deltafuse train: error: --seq-len {2**31} ") and "allowed: 2 to 2,147,483,647" \
        in lines[0], lines[0]
    assert not out.exists()


# --- item 6: a 20 MB JSONL line ------------------------------------------------------------------------
def _full_then_cut(tok, row, seq_len):
    """What encode_row computed before: the whole row tokenised, then cut."""
    text, spans, add_special = data._render(tok, row)
    enc = tok(text, add_special_tokens=add_special, return_offsets_mapping=True)
    labels = [t if e > s and any(a <= s < b for a, b in spans) else data.IGNORE_INDEX
              for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])]
    return enc["input_ids"][:seq_len], labels[:seq_len], len(enc["input_ids"]) > seq_len


@pytest.mark.parametrize("seq_len", [2, 64, 700, 3000, 9000])
@pytest.mark.parametrize("kind", ["prompt-completion", "messages", "plain"])
def test_truncating_at_tokenisation_keeps_exactly_the_tokens_the_whole_row_gives(tok, kind, seq_len):
    body = "".join(f"step {i}: 12 * {i} = <<12*{i}={12 * i}>>{12 * i} — ünïcode 日本\n" for i in range(300))
    if kind == "messages":
        row = {"messages": [{"role": "user", "content": body[:5000]}, {"role": "assistant", "content": body},
                            {"role": "user", "content": "more"}, {"role": "assistant", "content": body[::-1]}]}
    else:
        row = {"prompt": body[:3000], "completion": body}
    t = tok
    if kind == "plain":
        t = build_byte_tokenizer()
        t.chat_template = None
    assert data.encode_row(t, row, seq_len) == _full_then_cut(t, row, seq_len)


def test_a_20_mb_line_streams_truncated_with_progress_and_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        fh.write(json.dumps({"prompt": "Say it.", "completion": "ab" * 10_000_000}) + "\n")
        fh.write(json.dumps({"prompt": "2+2?", "completion": "#### 4"}) + "\n")
    assert path.stat().st_size > 20_000_000
    proc, elapsed, peak = run_cli(["--model", "tiny", "--data", str(path), "--seq-len", "128", "--max-steps", "1",
                                   "--progress", "--no-deltafuse", "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert peak is not None and peak < 1.5 * (1 << 30), f"peak RSS {peak / 2**20:.0f} MiB"
    assert elapsed < 300, f"{elapsed:.0f} s"
    assert "truncated 1 row(s) longer than --seq-len 128 tokens" in proc.stdout
    assert "reading big.jsonl" in proc.stderr  # the load shows its progress
    with open(tmp_path / "run" / "summary.json") as fh:
        stats = json.load(fh)["data"]
    short = len(data.encode_row(build_byte_tokenizer(), {"prompt": "2+2?", "completion": "#### 4"}, 128)[0])
    assert stats["examples"] == 2 and stats["tokens"] == 128 + short  # the long row is kept at --seq-len tokens
