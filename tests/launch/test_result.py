"""The harness result as a model (stratagem.launch.harness.result): a real harness run's file reads back, the part a
measured trial stores reads back too, the readers (real-run evaluation, reproduce, export) agree on it, and a
file that is not a result is one line naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.errors import StratagemError
from stratagem.evaluators import evaluate
from stratagem.launch.harness.result import parse_result, read_result
from stratagem.launch.reproduce import compare_results, environment_differences
from stratagem.launch.runners.real import measured_evaluation
from stratagem.spaces import load_scenario, parse_plan
from stratagem.units import GIB

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def result_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("harness") / "result.json"
    run = subprocess.run([sys.executable, "-m", "stratagem.launch.harness", "--scenario", str(EXAMPLE), "--plan",
                          "dp=1", "--steps", "2", "--warmup", "1", "--no-checkpoint", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def test_a_real_result_reads_back(result_file: Path) -> None:
    raw = json.loads(result_file.read_text())
    run = read_result(result_file)
    assert run.step_s == raw["step_s"] and run.tokens_per_s == pytest.approx(raw["tokens_per_step"] / raw["step_s"])
    assert run.steps == 2 and run.warmup == 1 and len(run.step_times_s) == 3 and len(run.losses) == 3
    assert run.plan == parse_plan("dp=1") and run.world_size == 1
    assert run.peak_gib == max(r["peak_bytes"] for r in raw["ranks"]) / GIB > 0


def test_the_stored_part_reads_back_and_compares_equal(result_file: Path) -> None:
    run = read_result(result_file)
    stored = parse_result(json.loads(json.dumps(run.stored())), "stored")
    assert stored.plan is None and stored.ranks == run.ranks and stored.losses == run.losses
    assert environment_differences(stored, run) == []
    rows, losses_match = compare_results(stored, run)
    assert losses_match and not any(r.flagged for r in rows)
    other = run.model_copy(update={"device": "NVIDIA H100", "world_size": 8})
    assert len(environment_differences(stored, other)) == 2


def test_the_real_run_evaluation_reads_the_model(result_file: Path) -> None:
    scn = load_scenario(EXAMPLE)
    plan = parse_plan("dp=1,zero=0")
    raw = json.loads(result_file.read_text())
    ev = measured_evaluation(scn, plan, "ok", "", raw, evaluate(scn, plan))
    run = read_result(result_file)
    assert ev.memory is not None and ev.memory.peak_gib == pytest.approx(run.peak_gib)
    assert ev.throughput is not None and ev.throughput.tokens_per_s == run.tokens_per_s
    assert ev.measurements == run.stored()


def test_not_a_result_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"step_s": 1.0, "tokens_per_s": 2.0}))
    with pytest.raises(StratagemError) as e:
        read_result(bad)
    assert "ranks" in str(e.value) and "\n" not in str(e.value)
    bad.write_text("{")
    with pytest.raises(StratagemError, match=r"harness result \(.*r.json\): not valid JSON"):
        read_result(bad)
    with pytest.raises(StratagemError, match="surprise: Extra inputs"):
        parse_result({"step_s": 1.0, "tokens_per_s": 1.0, "ranks": [], "surprise": 1}, "x")


def test_cpu_memory_noise_is_one_collective_tensor(result_file: Path) -> None:
    """On CPU, gloo's thread may still hold one collective's tensor when the step peaks: a shift of the largest
    parameter's fp32 bytes (the embedding here) is noise; twice that is a change."""
    run = read_result(result_file)
    model = load_scenario(EXAMPLE).model
    embedding = 4 * model.vocab_size * model.hidden_size

    def shifted(by: int):
        ranks = [r.model_copy(update={"peak_bytes": r.peak_bytes + by}) for r in run.ranks]
        return run.model_copy(update={"ranks": ranks})

    def memory_row(now):
        rows, _ = compare_results(run, now, model)
        return [r for r in rows if r.metric.startswith("peak memory")][0]

    assert not memory_row(shifted(embedding + 256)).flagged
    assert memory_row(shifted(2 * embedding + 128 * 1024)).flagged


def test_reproduce_judges_against_the_stored_spread(result_file: Path) -> None:
    """Issue 22 items 3-4: the result stores its timed steps' spread; a rerun reproduces the step time when
    the two 95 % intervals overlap, and the rows show both intervals."""
    from stratagem.evaluators.spread import spread_of_samples

    run = read_result(result_file)
    assert run.step_spread is not None and run.step_spread.median_s == run.step_s
    assert parse_result(json.loads(json.dumps(run.stored())), "stored").step_spread == run.step_spread

    def with_steps(times: list[float]):
        spread = spread_of_samples(times)
        tokens = run.tokens_per_s * run.step_s
        return run.model_copy(update={"step_s": spread.median_s, "step_spread": spread, "warmup": 0,
                                      "step_times_s": times, "tokens_per_s": tokens / spread.median_s})

    recorded = with_steps([1.00, 0.95, 1.05, 1.10, 0.90, 1.02, 0.98, 1.01])  # 95 % interval 0.90-1.10
    near = with_steps([1.12, 1.08, 1.20, 1.15, 1.05, 1.18, 1.10, 1.14])  # +12 %, interval 1.05-1.20: overlaps
    far = with_steps([1.40, 1.35, 1.45, 1.50, 1.30, 1.42, 1.38, 1.44])  # +40 %, interval 1.30-1.50
    for now, flagged in ((near, False), (far, True)):
        rows, _ = compare_results(recorded, now)
        step, tokens = [r for r in rows if r.metric == "step time"][0], rows[0]
        assert step.flagged is flagged and tokens.flagged is flagged
        assert (abs(step.rel_diff) > step.threshold) is flagged  # the band is the overlap rule, as a threshold
    rows, _ = compare_results(recorded, near)
    assert rows[1].band("recorded") == "1.00 s (0.900-1.10, n=8)" and rows[1].band("now").endswith("n=8)")
    # A rerun 40 % slower is beyond both runs' own intervals, but within a run-to-run band of 50 % (a study whose
    # re-measured plans moved that much, search/noise.py): not flagged; within a 10 % band: flagged.
    wide, _ = compare_results(recorded, far, run_band=0.5)
    narrow, _ = compare_results(recorded, far, run_band=0.1)
    assert not any(r.flagged for r in wide[:2]) and all(r.flagged for r in narrow[:2])
    assert wide[1].noise == 0.5 and narrow[1].noise == narrow[1].threshold and wide[1].noise_text == "±50.0%"
    assert compare_results(recorded, far, run_band=27.0)[0][1].noise_text == "×/÷28.0"
