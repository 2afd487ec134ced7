"""Two users' paths through the real CLI (`stratagem.cli:main`), each command reading what the last one wrote,
and every figure one command prints for a plan the same as the next command's for that plan:

- a capacity planner: `capacity` of Llama 3.1 405B and of DeepSeek-V3, then `explain` of each size's chosen plan
  (headroom, its zone level, tokens/s agree; no chosen plan rests in a bad zone), then the reverse question
  (`--days`) answered by a size whose forward row trains in time;
- a training engineer: `search` of the 70B example (analytic), `explain` and `compare` of its front, `export` of
  its best plan to Megatron-LM and torchtitan as a throughput check (every step logged, no checkpoint inside).
The researcher's path (demo with real runs -> status -> report -> reproduce -> resume) is
tests/search/test_user_path_demo.py (real runs: the integration suite)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import test_cli
import tomllib
import yaml

from stratagem.spaces import parse_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# DeepSeek-V3's pre-training shape (DeepSeek-V3 technical report, arXiv:2412.19437, section 4.2: 4K sequences,
# batch 15,360 sequences, 14.8T tokens), on H100s (the report's H800s are not a preset).
DSV3 = {"model": "deepseek-v3",
        "cluster": {"gpu": "h100-sxm-80g", "num_nodes": 256, "gpus_per_node": 8},
        "training": {"seq_len": 4096, "global_batch_size": 15360, "stack": "megatron", "training_tokens": 1.48e13},
        "search": {"precision": ["bf16", "fp8"], "memory_margin_gib": 2.0}}


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`stratagem ARGS` in-process (test_cli.run); never a traceback."""
    code, out, err = test_cli.run(monkeypatch, capsys, *args)
    assert "Traceback" not in out + err, out + err
    return code, out, err


def capacity_rows(markdown: str) -> list[dict[str, str]]:
    """The capacity table of `capacity -o F.md`, a dict per size keyed by the header."""
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")), strict=True)) for ln in lines[1:]]


def three_figures(x: float) -> str:
    """x as the tables print it: three significant figures, thousands grouped."""
    return f"{float(f'{x:.3g}'):,.{max(0, 2 - int(f'{x:e}'.split('e')[1]))}f}"


def at_size(scenario: dict, nodes: int, path: Path) -> Path:
    """The scenario at `nodes` nodes, written to `path`."""
    path.write_text(yaml.safe_dump({**scenario, "cluster": {**scenario["cluster"], "num_nodes": nodes}}))
    return path


@pytest.mark.parametrize("name,nodes", [("llama3-405b", ""), ("deepseek-v3", "128,256")])
def test_a_capacity_planners_path_agrees_with_explain_and_the_reverse_question(
        name: str, nodes: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    scenario = (yaml.safe_load((EXAMPLES / "llama3-405b-1024xh100.yaml").read_text()) if name == "llama3-405b"
                else DSV3)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(scenario))
    sizes = ["--nodes", nodes] if nodes else []
    code, out, err = run(monkeypatch, capsys, "capacity", str(path), *sizes, "-o", str(tmp_path / "cap.md"))
    assert code == 0, err
    rows = capacity_rows((tmp_path / "cap.md").read_text())
    assert len(rows) >= 2, rows
    for row in rows:
        label = row["best plan"].strip("`")
        size = at_size(scenario, int(row["nodes"]), tmp_path / f"{name}-{row['nodes']}.yaml")
        code, out, err = run(monkeypatch, capsys, "explain", str(size), "--plan", label, "--json")
        assert code == 0, err
        ev = json.loads(out)["evaluation"]
        assert parse_plan(label) == parse_plan(ev["plan"]), (label, ev["plan"])
        hbm = ev["zones"]["hbm"]
        # capacity's headroom cell: "GiB (share of HBM)" then the zone level when it is not ok
        level = "" if hbm["level"] == "ok" else f" {hbm['level']}"
        assert row["headroom GiB (share of HBM)"] == (f"{three_figures(ev['memory']['headroom_gib'])} "
                                                      f"({100 * hbm['value']:.3g}%){level}"), (row, hbm)
        assert row["tokens/s"] == three_figures(ev["throughput"]["tokens_per_s"]), (row, ev["throughput"])
        # the risk-aware pick (evaluators.risk_pick): a chosen plan in a bad zone only when none within noise
        # of it is better; at these sizes each has plans with room to spare
        assert all(z["level"] != "bad" for k, z in ev["zones"].items() if k != "bottleneck"), (row, ev["zones"])

    # the reverse question: the fewest GPUs that train in the days the middle size takes, at most that size
    middle = rows[len(rows) // 2]
    days = float(middle["days"].replace(",", "")) * 1.02
    code, out, err = run(monkeypatch, capsys, "capacity", str(path), *sizes, "--days", f"{days:.4g}")
    assert code == 0, err
    answer = re.search(r"fewest GPUs to train in [\d.,]+ days: (\d+) nodes \(\d+ GPUs\), (.+?), ([\d.,]+) days",
                       " ".join(out.split()))
    assert answer, out
    assert int(answer.group(1)) <= int(middle["nodes"]) and float(answer.group(3).replace(",", "")) <= days, out
    forward = {row["nodes"]: row for row in rows}.get(answer.group(1))
    if forward is not None:  # a size of the forward table: the same plan and days
        assert (answer.group(2), answer.group(3)) == (forward["best plan"].strip("`"), forward["days"]), out


def test_a_training_engineers_path_search_explain_compare_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "llama3-70b.yaml"
    path.write_text((EXAMPLES / "llama3-70b-64xh100.yaml").read_text())
    code, out, err = run(monkeypatch, capsys, "search", str(path), "--no-report", "--json")
    assert code == 0, err
    front = sorted(json.loads(out)["front"], key=lambda f: -f["values"][0])
    assert len(front) >= 2
    best, second = front[0], front[1]

    for entry in (best, second):  # explain of a front trial: the same plan, tokens/s and headroom as the front
        code, out, err = run(monkeypatch, capsys, "explain", str(path), "--trial", str(entry["number"]), "--json")
        assert code == 0, err
        ev = json.loads(out)["evaluation"]
        assert parse_plan(ev["plan"]) == parse_plan(entry["params"])
        assert ev["throughput"]["tokens_per_s"] == pytest.approx(entry["values"][0], rel=1e-9)
        assert ev["memory"]["headroom_gib"] == pytest.approx(entry["values"][1], rel=1e-9)

    code, out, err = run(monkeypatch, capsys, "compare", str(path), str(best["number"]), str(second["number"]),
                         "--json")
    assert code == 0, err
    compared = {p["name"]: p["evaluation"] for p in json.loads(out)["plans"]}
    for entry in (best, second):
        ev = compared[f"trial:{entry['number']}"]
        assert ev["throughput"]["tokens_per_s"] == pytest.approx(entry["values"][0], rel=1e-9)
        assert ev["memory"]["headroom_gib"] == pytest.approx(entry["values"][1], rel=1e-9)
    code, out, err = run(monkeypatch, capsys, "compare", str(path), str(best["number"]), str(second["number"]))
    assert code == 0, err
    best_label = parse_plan(best["params"]).short()
    second_label = parse_plan(second["params"]).short()
    why = " ".join(out.split())  # the table wraps long lines
    assert f"{best_label} is " in why and f"faster ({three_figures(best['values'][0])} vs " in why, why
    assert f"{second_label}'s step is " in why, why  # the slower plan's step is the longer one
    cells = next(ln for ln in out.splitlines() if ln.strip("│ ").startswith("bottleneck"))  # the front's words
    assert best["bottleneck"] in cells and second["bottleneck"] in cells, (cells, best, second)

    code, out, err = run(monkeypatch, capsys, "export", str(path), "--best", "tokens", "--to", "megatron")
    assert code == 0, err
    assert f"trial #{best['number']}: {best_label}" in err, err
    plan = parse_plan(best["params"])
    args = out.split("\n")
    assert f"  --tensor-model-parallel-size {plan.tp}" in args and f"  --micro-batch-size {plan.micro_batch_size}" in args
    assert "  --log-interval 1" in args and "  --log-throughput" in args, out
    assert not any(a.strip().startswith("--save ") for a in args), out  # no checkpoint inside the timed steps

    code, out, err = run(monkeypatch, capsys, "export", str(path), "--best", "tokens", "--to", "torchtitan",
                         "-o", str(tmp_path / "tt"))
    assert code == 0, err
    (toml_file,) = (tmp_path / "tt").glob("*.toml")
    job = tomllib.loads(toml_file.read_text())
    degrees = job["parallelism"]
    assert degrees["tensor_parallel_degree"] == plan.tp and degrees["pipeline_parallel_degree"] == plan.pp
    assert degrees["data_parallel_replicate_degree"] * degrees["data_parallel_shard_degree"] == plan.dp
    assert job["training"]["local_batch_size"] == plan.micro_batch_size
    assert job["metrics"]["log_freq"] == 1 and job["checkpoint"]["enable"] is False
