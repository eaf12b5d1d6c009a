"""Bad input outside `decode eval` (issue 11): every value out of range is one line naming the flag/field
and the valid range; nothing is silently coerced."""
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from decode.choose.arms import ArmEnv, build_arm
from decode.commands.cli import main as decode_main
from decode.common.errors import UserError
from decode.choose.length import build_length
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from helpers import TinyTokenizer, tiny_llama

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env():
    return ArmEnv(tiny_llama(seed=1), TinyTokenizer(64), SamplingConfig())


# --------------------------------------------------------------------------- component specs

@pytest.mark.parametrize("spec, needle", [
    ("pld:L=2.5", r"arm 'pld:L=2.5'.*L must be an integer >= 0, got '2.5'"),
    ("pld:L=abc", r"L must be an integer >= 0, got 'abc'"),
    ("pld:n=0", r"n must be an integer >= 1, got '0'"),
    ("suffix:min_match=0", r"min_match must be an integer >= 1, got '0'"),
    ("suffix:L=-1", r"L must be an integer >= 0, got '-1'"),
    ("suffix:min_mach=2", r"unknown parameter 'min_mach'; did you mean 'min_match'\?"),
    ("pld:l=3", r"unknown parameter 'l'; did you mean 'L'\?"),
    ("none:L=3", r"'none' takes no parameters"),
    ("pld:L=3,L=4", r"'L' is given twice"),
    ("drafter:L=2", r"missing required parameter 'path'"),
    ("drafter:path=/nowhere,L=0", r"L must be an integer >= 1, got '0'"),
    ("drafter:path=/nowhere", r"arm 'drafter:path=/nowhere': .*not an existing folder"),
])
def test_bad_arm_specs_name_arm_parameter_value_and_range(env, spec, needle):
    with pytest.raises(UserError, match=needle):
        build_arm(spec, env)


def test_arm_spec_values_are_typed_not_guessed(env):
    arm = build_arm("pld:L=3,n=2", env)
    assert (arm.L, arm.max_ngram) == (3, 2) and type(arm.L) is int
    assert build_arm("suffix:L=+4,min_match=1", env).min_match == 1


@pytest.mark.parametrize("spec, needle", [
    ("ucbspec:delta=abc", r"policy 'ucbspec:delta=abc'.*delta must be a finite number, got 'abc'"),
    ("ucbspec:delta=inf", r"delta must be a finite number, got 'inf'"),
    ("swucb:window=2.5", r"window must be an integer, got '2.5'"),
    ("thompson:carry=yes", r"carry must be true or false, got 'yes'"),
    ("ucbspec:deltaa=0.1", r"bad parameters: unknown parameter 'deltaa'; did you mean 'delta'\?"),
    ("ucbspec:n_arms=3", r"unknown parameter 'n_arms'"),
    ("ucbspec:delta=100", r"delta must be in \(0, 1\]"),  # δ > 1 made the radius' log negative mid-run
    ("ucbspec:seed=-1", r"seed must be an integer >= 0"),
])
def test_policy_specs_get_the_same_typed_checks(spec, needle):
    with pytest.raises(UserError, match=needle):
        build_policy(spec, 3, 4)


def test_policy_spec_may_set_its_own_seed():
    assert build_policy("ucbspec:seed=3", 3, 4, seed=7).seed == 3  # was a TypeError: seed passed twice
    assert build_policy("ucbspec", 3, 4, seed=7).seed == 7


@pytest.mark.parametrize("spec", ["eagle:path=x,L=0", "early_exit:path=x,L=0"])
def test_self_drafting_arms_need_a_positive_length(spec, env):
    with pytest.raises(UserError, match=r"L must be an integer >= 1, got '0'"):
        build_arm(spec, env)


def test_length_specs_get_the_same_typed_checks():
    with pytest.raises(UserError, match=r"seed must be an integer >= 0"):
        build_length("beta-ts:seed=-1")
    with pytest.raises(UserError, match=r"length controller 'beta-ts:alpha=abc'.*alpha must be a finite number"):
        build_length("beta-ts:alpha=abc")
    assert build_length("beta-ts:alpha=2,carry=true").carry is True


# --------------------------------------------------------------------------- decode simulate

@pytest.mark.parametrize("flags, needle", [
    (["--L", "0"], "--L must be"),
    (["--L", "2.5"], "--L must be"),
    (["--p", "0,0.5"], "--p"),
    (["--p", "0.5,nan"], "--p"),
    (["--switch-at", "0", "--p-after", "0.5,0.6,0.7,0.8,0.3"], "--switch-at must be"),
    (["--switch-at", "10000", "--p-after", "0.5,0.6,0.7,0.8,0.3"], "--switch-at must be"),
    (["--points", "0"], "--points must be"),
    (["--seeds", "0"], "--seeds must be"),
    (["--length", "1"], "--length must be"),
    (["--concentration", "-1"], "--concentration must be"),
    (["--draft-cost", "nan"], "--draft-cost must be"),
    (["--verify-cost", "-0.5"], "--verify-cost must be"),
])
def test_simulate_rejects_out_of_range_flags(tmp_path, capsys, flags, needle):
    assert decode_main(["simulate", *flags, "--no-plot", "--no-progress", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err
    assert not (tmp_path / "r.json").exists()


# --------------------------------------------------------------------------- decode bench-verify

@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "0"], "--temperature must be > 0 with --mode sample"),
    (["--temperature", "nan"], "--temperature"),
    (["--mode", "greedy", "--temperature", "0.7"], "--mode greedy"),
    (["--mode", "greedy", "--top-k", "5"], "--mode greedy"),
    (["--reps", "0"], "--reps must be"),
    (["--warmup-ms", "0"], "--warmup-ms must be"),
    (["--rep-ms", "-1"], "--rep-ms must be"),
    (["--peak-gbps", "nan"], "--peak-gbps must be"),
])
def test_bench_verify_rejects_bad_flags(tmp_path, capsys, flags, needle):
    out = tmp_path / "b.json"
    assert decode_main(["bench-verify", "--device", "cpu", "--vocab", "64", "--draft-len", "1", "--batch", "1",
                        "--dtypes", "fp32", "--reps", "1", "--no-progress", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err
    assert not out.exists()


# --------------------------------------------------------------------------- distill recipe

def test_distill_shard_size_must_be_a_multiple_of_batch_size(capsys):
    from toolkit.cli import main as toolkit_main
    from toolkit.distill import load_distill_recipe

    with pytest.raises(UserError, match=r"shard_size=5 must be a multiple of generation.batch_size=32"):
        load_distill_recipe(task="math", overrides=["shard_size=5"])
    assert load_distill_recipe(task="math", overrides=["shard_size=64"]).shard_size == 64
    assert toolkit_main(["distill", "--task", "math", "shard_size=48", "generation.batch_size=32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "shard_size" in err and "generation.batch_size" in err and "\n" not in err


@pytest.mark.parametrize("override, needle", [
    ("num_prompts=0", "num_prompts must be >= 1 or null"),
    ("generation.temperatures=[0.0, .nan]", "generation.temperatures must be distinct, finite and >= 0"),
    ("generation.top_p=0", r"generation.top_p must be in \(0, 1\]"),
    ("generation.top_k=-1", "generation.top_k must be >= 0"),
])
def test_distill_recipe_ranges_name_the_recipe_field(override, needle):
    from toolkit.distill import load_distill_recipe

    with pytest.raises(UserError, match=needle):
        load_distill_recipe(task="math", overrides=[override])


# --------------------------------------------------------------------------- pools

def test_pool_error_for_an_untrained_drafter_names_its_task_not_its_label(tmp_path):
    from decode.engine.pools import load_pool

    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"drafters": [
        {"name": "math-drafter", "path": str(tmp_path / "runs/drafters/cpu-small/math/export")},
        {"name": "code-drafter", "path": str(tmp_path / "runs/drafters/cpu-small-ft/code/export")}]}))
    with pytest.raises(UserError) as e:
        load_pool(pool)
    msg = str(e.value)
    assert "TASK=math-drafter" not in msg and "`make train-drafter TASK=math`" in msg
    assert "`make train-drafter TASK=code DRAFTER_RECIPE=recipes/drafters/cpu-small-ft.yaml`" in msg
    assert "make distill TASK=math" in msg and "min" in msg and "\n" not in msg


# --------------------------------------------------------------------------- train-drafter launcher

def _train_drafter(*args):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "scripts/train_drafter.py", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    return r, time.perf_counter() - t0


def test_train_drafter_rejects_an_unknown_task_before_anything_heavy():
    r, seconds = _train_drafter("--check", "--recipe", "recipes/drafters/cpu-small.yaml", "--task", "nonexistent")
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith("error: ") and "unknown task 'nonexistent'" in lines[0]
    assert "chat, code, math, qa, summarization, translation" in lines[0] and "make distill" not in lines[0]
    assert seconds < 15  # no torch, no model: well under the ~5 s torch + transformers import on 2 cores
    r, _ = _train_drafter("--recipe", "recipes/drafters/cpu-small.yaml", "--task", "nonexistent")
    assert r.returncode == 2 and "Loading" not in r.stdout + r.stderr


def test_train_drafter_without_distilled_data_suggests_a_distill_command_that_exists(tmp_path):
    from toolkit.distill import load_distill_recipe

    r, _ = _train_drafter("--check", "--recipe", "recipes/drafters/cpu-small.yaml", "--task", "math",
                          f"data.root={tmp_path}")
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "`make distill TASK=math" in lines[0]
    assert load_distill_recipe(task="math").task == "math"  # the suggested command's recipe loads
    (tmp_path / "math").mkdir()
    (tmp_path / "math" / "manifest.json").write_text("{}")
    r, _ = _train_drafter("--check", "--recipe", "recipes/drafters/cpu-small.yaml", "--task", "math",
                          f"data.root={tmp_path}")
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip()


def test_missing_data_for_an_unknown_task_lists_the_tasks_not_a_failing_distill(tmp_path):
    from toolkit.train.data import DataSection, distilled_dirs
    with pytest.raises(UserError, match=r"available tasks: .*math"):
        distilled_dirs(DataSection(root=str(tmp_path)), "nonexistent")
    with pytest.raises(UserError, match=r"make distill TASK=math"):
        distilled_dirs(DataSection(root=str(tmp_path)), "math")
