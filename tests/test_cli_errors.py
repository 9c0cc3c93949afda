"""User errors of the `deltafuse` command: one line on stderr, exit 2, before any model is built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deltafuse import models
from deltafuse import verify as verify_package
from deltafuse.verify import core as verify
from deltafuse.cli import main
from tests.helpers import clean_subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("clean_deltafuse")


@pytest.fixture
def nothing_built(monkeypatch):
    """Building or loading a model fails the test: user errors must be reported before that."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was built or loaded before the user error was reported")

    monkeypatch.setattr(models, "build_model", forbidden)
    monkeypatch.setattr(models, "load_local_model", forbidden)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert "Traceback" not in err
    return lines[0]


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors
        return exc.code


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "-inf", "abc"])
def test_bad_rtol_is_refused_at_parse_time(value, capsys, nothing_built):
    assert _exit_code(["verify", "--model", "tiny", f"--rtol={value}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("deltafuse verify: error: argument --rtol:")
    assert repr(value) in line and "finite number > 0" in line


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), 0.0, True])
def test_bad_rtol_is_refused_by_the_api(value, nothing_built):
    with pytest.raises(verify.VerifyError, match="rtol=.*finite number > 0"):
        verify.verify_model("tiny", rtol=value)


@pytest.mark.parametrize("value", ["-3", "1.5", str(2**63)])
def test_bad_seed(value, capsys, nothing_built):
    assert _exit_code(["verify", "--seed", value]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "argument --seed" in line and "0 <= seed < 2**63 - 1" in line


@pytest.mark.parametrize("argv, words", [
    (["verfy"], ["invalid choice: 'verfy'", "'verify'"]),
    ([], ["required", "{info,verify,train,bench}"]),
    (["info", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["bench"], ["deltafuse bench: error:", "{e2e,ops}"]),
    (["bench", "e3e"], ["invalid choice: 'e3e'", "'e2e'"]),
    (["verify", "--device", "tpu"], ["argument --device", "'tpu'", "'cuda'"]),
])
def test_bad_command_lines(argv, words, capsys):
    assert _exit_code(argv) == 2
    line = _one_line(capsys.readouterr().err)
    for word in words:
        assert word in line


@pytest.mark.parametrize("argv", [["verify", "--model", "tiny"], ["info"], ["bench", "ops"]])
@pytest.mark.parametrize("name, value, allowed", [
    ("DELTAFUSE_GDN", "maybe", "1/true/yes/on/0/false/no/off"),
    ("DELTAFUSE_PATCH", "2", "1/true/yes/on/0/false/no/off"),
    ("DELTAFUSE_BACKEND", "cuda", "auto, triton, fla, npu, flash_qla, torch"),
    ("DELTAFUSE_VALIDATE", "sometimes", "1/true/yes/on/0/false/no/off"),
    ("TWINKLE_NPU_FLA", "maybe", "1/true/yes/on/0/false/no/off"),
])
def test_bad_environment_is_reported_before_anything_runs(argv, name, value, allowed, monkeypatch, capsys,
                                                          nothing_built):
    import deltafuse.bench.ops as bench_ops

    monkeypatch.setattr(bench_ops, "run_ops", lambda args: pytest.fail("bench ran with a bad environment"))
    with monkeypatch.context() as env:  # undone before clean_deltafuse's check at teardown
        env.setenv(name, value)
        assert _exit_code(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{name}={value!r}" in line and allowed in line
    assert line.startswith(f"deltafuse {argv[0]}: error:")


def test_unknown_deltafuse_variable_is_a_warning(monkeypatch, capsys):
    monkeypatch.setenv("DELTAFUSE_GDM", "0")
    assert main(["info", "--json"]) == 0
    line = _one_line(capsys.readouterr().err)
    assert "warning: DELTAFUSE_GDM is not a deltafuse variable" in line and "DELTAFUSE_GDN" in line


def test_patch_off_is_refused_before_the_model_is_built(monkeypatch, capsys, nothing_built):
    monkeypatch.setenv("DELTAFUSE_PATCH", "off")
    assert main(["verify", "--model", "tiny"]) == 2
    assert "DELTAFUSE_PATCH is off" in _one_line(capsys.readouterr().err)


def test_forced_triton_on_cpu_names_the_variable_and_what_works(monkeypatch, capsys, nothing_built):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Triton interpreter would serve CPU tensors
    with monkeypatch.context() as env:  # undone before clean_deltafuse's check at teardown
        env.setenv("DELTAFUSE_BACKEND", "triton")
        assert main(["verify", "--model", "tiny"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "DELTAFUSE_BACKEND='triton'" in line and "cpu float32" in line and "chunk_gated_delta_rule" in line
    assert "not cpu" in line and "allowed for cpu float32: auto, torch" in line


def test_forced_triton_under_the_interpreter_serves_fp32_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    assert verify.forced_backend_problems("triton", cpu, torch.float32) == {}
    problems = verify.forced_backend_problems("triton", cpu, torch.bfloat16)
    assert "chunk_gated_delta_rule" in problems
    assert all("fp32 only" in why for why in problems.values())
    # the recurrent op's Triton candidate serves training calls too (through the chunked kernels)
    assert "fused_recurrent_gated_delta_rule" not in verify.forced_backend_problems("triton", cpu, torch.float32)
    assert verify.forced_backend_problems("torch", cpu, torch.bfloat16) == {}


def test_broken_config_json(tmp_path, capsys, nothing_built):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_text", ')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert main(["verify", "--model", str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert repr(str(tmp_path)) in line and "config.json cannot be read by transformers" in line


def test_unsupported_family_is_refused_from_its_config(tmp_path, capsys, nothing_built):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config decides
    assert main(["verify", "--model", str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "LlamaConfig" in line and "'llama'" in line and "Qwen3.5, Qwen3.5-MoE and Qwen3-Next" in line


def test_directory_without_weights(tmp_path, capsys, nothing_built):
    models.build_config("tiny").save_pretrained(tmp_path)
    assert main(["verify", "--model", str(tmp_path)]) == 2
    assert "has no *.safetensors weights" in _one_line(capsys.readouterr().err)


def test_a_crash_of_verify_is_not_a_verdict(monkeypatch, capsys):
    """Exit 1 means only 'out of tolerance': a failure inside verify is exit 3 with its traceback."""

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure inside the reference run")

    monkeypatch.setattr(verify, "_stock_run", boom)
    assert main(["verify", "--model", "tiny"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "simulated failure" in err and "internal error" in err


def test_module_entry_point_uses_the_same_rules(capsys, nothing_built):
    with pytest.raises(SystemExit) as exc:
        verify_package.main(["--rtol", "nan"])
    assert exc.value.code == 2
    assert "deltafuse verify: error: argument --rtol:" in _one_line(capsys.readouterr().err)


def test_errors_from_a_real_process_are_one_line():
    """The same through `python -m deltafuse` in a fresh process (nothing from the test process leaks in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTAFUSE_", "TWINKLE_NPU_"))}
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cases = [
        (["verify", "--rtol", "nan"], {}, "argument --rtol"),
        (["verify"], {"DELTAFUSE_GDN": "maybe"}, "DELTAFUSE_GDN='maybe'"),
        (["verify"], {"DELTAFUSE_BACKEND": "triton"}, "DELTAFUSE_BACKEND='triton'"),
        (["bogus"], {}, "invalid choice: 'bogus'"),
    ]
    for argv, extra, words in cases:
        proc = subprocess.run([sys.executable, "-m", "deltafuse", *argv], env={**env, **extra}, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2, (argv, extra, proc.stderr)
        assert words in _one_line(proc.stderr)
        assert proc.stdout == ""


# --- checked before anything heavy is imported ---------------------------------------------------------------
HEAVY = ("transformers", "peft", "trl", "accelerate", "scipy", "datasets")
# what a line that argparse (or `verify --model`) refuses imports nothing of, torch included
HEAVY_AND_TORCH = HEAVY + ("torch", "triton", "numpy")
_IMPORTS_OF = """
import json, sys
from deltafuse.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(os_heavy)))
print(json.dumps({"rc": rc, "imported": heavy}))
"""


def _fresh_env() -> dict:
    return clean_subprocess_env()


def _imports_of(argv: list[str], heavy: tuple[str, ...]) -> tuple[int, list[str], str]:
    """(exit status, the modules of ``heavy`` that ``deltafuse ARGV`` imported, its stderr), in a fresh process."""
    import json

    code = f"os_heavy = {json.dumps(json.dumps(heavy))}\n" + _IMPORTS_OF
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=_fresh_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["rc"], result["imported"], proc.stderr


@pytest.mark.parametrize("argv, words", [
    (["train", "--bogus-flag"], "deltafuse train: error: unrecognized arguments: --bogus-flag"),
    (["train", "--seq-len", "abc"], "argument --seq-len: 'abc' is not an integer"),
    (["train", "--modle", "tiny"], "unrecognized arguments: --modle tiny"),  # a one-word typo
    (["train", "--bogus_flag", "1"], "unrecognized arguments: --bogus_flag 1"),  # not a TrainingArguments field
    (["bench", "e2e", "--max-steps", "0"], "argument --max-steps: 0 is too small"),
    (["bench", "e2e", "--bogus"], "deltafuse bench e2e: error: unrecognized arguments: --bogus"),
    (["bench", "ops", "--bogus"], "deltafuse bench ops: error: unrecognized arguments: --bogus"),
    (["bench", "ops", "--op", "nope"], "argument --op: invalid choice: 'nope' (choose from 'chunk_gated_delta_rule'"),
    (["bench", "ops", "--shape", "1,80,2"], "argument --shape: '1,80,2' is not a shape; allowed: B,T,H,HV,D"),
    (["bench", "ops", "--shape", "1,80,3,4,16"], "argument --shape: '1,80,3,4,16': HV=4 must be a multiple of H=3"),
    (["bench", "ops", "--device", "gpu"],
     "argument --device: 'gpu' is not a device; allowed: auto, cpu, cpu:0, cuda, cuda:N"),
    (["bench", "ops", "--tokens", "1"], "argument --tokens: 1 is too small; allowed: an integer >= 2"),
    (["verify", "--model", "nope"], "--model 'nope' is neither a known name (tiny,"),
    (["train", "--model", "nope"], "--model 'nope' is neither a known model name nor a directory"),
    (["verify", "--rtol", "nan"], "argument --rtol: 'nan' is not allowed"),
    (["info", "--bogus"], "deltafuse info: error: unrecognized arguments: --bogus"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_a_bad_command_line_imports_neither_torch_nor_transformers(argv, words):
    rc, imported, err = _imports_of(argv, HEAVY_AND_TORCH)
    assert rc == 2 and words in _one_line(err)
    assert imported == [], f"{argv} imported {imported} before refusing the command line"


@pytest.mark.parametrize("argv, words", [
    (["train", "--model", "nope", "--output-dir", "{tmp}/o"], "--model 'nope' is neither a known model name"),
    (["bench", "e2e", "--context-parallel", "2", "--output-dir", "{tmp}/o"], "--context-parallel 2 with bench e2e"),
])
def test_input_errors_are_refused_before_transformers_is_imported(argv, words, tmp_path):
    rc, imported, err = _imports_of([a.format(tmp=tmp_path) for a in argv], HEAVY)
    assert rc == 2 and words in _one_line(err)
    assert imported == [], f"{argv} imported {imported} before refusing its input"
    assert not (tmp_path / "o").exists()


def test_help_imports_neither_torch_nor_transformers():
    for argv in (["--help"], ["train", "--help"], ["verify", "--help"], ["bench", "e2e", "--help"],
                 ["bench", "ops", "--help"]):
        rc, imported, err = _imports_of(argv, HEAVY_AND_TORCH)
        assert (rc, imported, err) == (0, [], ""), argv


def test_a_trainingarguments_option_is_still_passed_through():
    """Its names come from transformers, imported only when the command line has an option that may be one."""
    from deltafuse.cli import build_parser

    args = build_parser().parse_args(["train", "--gradient_accumulation_steps", "4", "--no_dataloader_pin_memory",
                                        "--lr", "1e-3"])
    assert vars(args)["hf:--gradient_accumulation_steps"] == ["--gradient_accumulation_steps", "4"]
    assert vars(args)["hf:--no_dataloader_pin_memory"] == ["--no_dataloader_pin_memory"] and args.lr == 1e-3
    e2e = build_parser().parse_args(["bench", "e2e", "--weight_decay", "0.1"])
    assert vars(e2e)["hf:--weight_decay"] == ["--weight_decay", "0.1"]


def test_trainingarguments_fields_read_without_transformers_match_its_parser():
    """The source-read field names that decide whether transformers is imported cover every passed-through
    option, and nothing else counts as one."""
    from deltafuse.train import hfargs

    options = hfargs.passthrough_options()
    assert hfargs._source_fields() is not None
    assert all(hfargs.may_be_passthrough(opt) for opt in options)
    assert not any(hfargs.may_be_passthrough(opt) for opt in ("--bogus", "--modle", "--no_bogus", "--bogus-flag"))


def test_named_model_names_as_data_are_the_models():
    from deltafuse import model_names

    assert model_names.NAMED_MODELS == tuple(models.NAMED_MODELS)
    assert model_names.TINY_NAMES == models.TINY_NAMES
    from deltafuse.verify import args as verify_args

    assert set(verify_args.DTYPE_NAMES) == set(verify.DTYPES)


# --- a subcommand's errors and help are its own ------------------------------------------------------------
@pytest.mark.parametrize("argv, prog", [
    (["info", "--bogus"], "deltafuse info"),
    (["verify", "--bogus"], "deltafuse verify"),
    (["train", "--bogus-flag"], "deltafuse train"),
    (["bench", "--bogus", "e2e"], "deltafuse bench"),
    (["bench", "e2e", "--bogus"], "deltafuse bench e2e"),
    (["bench", "ops", "--bogus"], "deltafuse bench ops"),
    (["--bogus", "info"], "deltafuse"),
])
def test_unknown_option_points_at_its_own_commands_help(argv, prog, capsys):
    assert _exit_code(argv) == 2
    line = _one_line(capsys.readouterr().err)
    bogus = next(a for a in argv if a.startswith("--"))
    assert line == f"{prog}: error: unrecognized arguments: {bogus} (see {prog} --help)"


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv, codes", [
    ([], (0, 1, 2, 3, 130, 143)),
    (["info"], (0, 1, 2, 130, 143)),
    (["verify"], (0, 1, 2, 3, 130, 143)),
    (["train"], (0, 1, 2, 130, 143)),
    (["bench"], (0, 1, 2, 130, 143)),
    (["bench", "e2e"], (0, 1, 2, 130, 143)),
    (["bench", "ops"], (0, 1, 2, 130, 143)),
])
def test_every_command_has_a_description_and_its_exit_codes(argv, codes, capsys):
    import re

    text = _help(argv, capsys)
    usage, description = text.split("\n\n")[:2]
    assert usage.startswith("usage: deltafuse") and len(description.split()) >= 8, text
    listed = text.split("exit codes:\n", 1)[1]
    found = [int(m) for m in re.findall(r"^  (\d+) +\S", listed, flags=re.M)]
    assert tuple(found) == codes, listed
    assert "interrupted (Ctrl-C)" in listed and "terminated (SIGTERM)" in listed


@pytest.mark.parametrize("argv", [[], ["info"], ["verify"], ["train"], ["bench"], ["bench", "e2e"],
                                  ["bench", "ops"]])
def test_help_points_at_no_file_a_user_does_not_have(argv, capsys):
    text = _help(argv, capsys)
    for name in ("DESIGN.md", "README", "BENCHMARKS.md", "benchmarks/", "tests/"):
        assert name not in text, (argv, name)
