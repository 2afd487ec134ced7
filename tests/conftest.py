import os
import tempfile

import pytest

from stratagem.search.noise_floor import NOISE_DIR_ENV
from stratagem.spaces import Scenario, cluster_preset, model_preset

# The host's noise file (search/noise_floor.py) pools every study's repeated runs: tests never write the user's,
# and each test starts from an empty one (a stand-in's injected noise must not leak into another test's estimate).
# Set at import, before any test module copies os.environ for its subprocesses.
os.environ[NOISE_DIR_ENV] = tempfile.mkdtemp(prefix="stratagem-noise-")


@pytest.fixture(autouse=True)
def _own_noise_file(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NOISE_DIR_ENV, str(tmp_path_factory.mktemp("noise")))


@pytest.fixture
def llama8b() -> Scenario:
    return Scenario(
        model=model_preset("llama3-8b"),
        cluster=cluster_preset("h100-sxm-80g", 8),
        training={"seq_len": 8192, "global_batch_size": 64},
    )


# CI (.ci/run sets STRATAGEM_STRICT_SKIPS=1) fails when a test skips for any reason but a missing optional package
# (DeepSpeed's parser; NeMo Automodel's, which `make test` installs unless PyPI is out of reach):
# a fresh clone has its reference data, Chromium and PostgreSQL (installed by `make test` as root), so a skip
# there means a check silently did not run.
OPTIONAL_PACKAGES = ("deepspeed", "nemo_automodel")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import os

    if os.environ.get("STRATAGEM_STRICT_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    unexpected = [r for r in skipped if not any(p in str(r.longrepr).lower() for p in OPTIONAL_PACKAGES)]
    if unexpected:
        for r in unexpected:
            print(f"\nunexpected skip (STRATAGEM_STRICT_SKIPS=1): {r.nodeid}: {r.longrepr}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Process-launching integration suites run by `make test-all` and `.ci/run`, not by `make test` (issue 23 item 4):
# node-id prefix -> why. Each kind keeps one fast case in the default suite, named in the comment, so that no
# component goes untested by `make test`.
INTEGRATION: dict[str, str] = {
    # harness: test_harness_cli.py (tp=2 under torchrun, ranks launched like the Ray runner) and
    # test_harness_model.py stay default
    "tests/launch/test_harness_coverage.py": "world 2 and 4 harness matrices of issue 15's mechanisms",
    "tests/launch/test_harness_plans.py": "world 2, 4 and 8 harness matrices (227 s of setup at load 10-20)",
    # calibrate: test_calibrate_node.py's real CPU calibration stays default
    "tests/launch/test_calibrate_node.py::test_search_starts_from_the_calibration_and_the_report_says_so":
        "a calibrate then a real-run search",
    # the regret benchmark and the traced phase: their fast tests stay default
    "tests/evaluators/test_table.py::test_regret_benchmark_replays_every_method": "bench/search_regret.py replay",
    "tests/search/test_multifidelity.py::test_no_real_run_for_a_plan_whose_traced_memory_does_not_fit":
        "stores every plan of the space as a traced trial, then a real-run loop",
    # Ray: test_ray_runs.py's module study (crash, hang, OOM, ok through a local Ray cluster) stays default
    "tests/launch/test_ray_runs.py::test_killed_driver_resumes_without_loss_or_repeat": "SIGKILL/resume on Ray",
    "tests/launch/test_ray_runs.py::test_export_torchrun_then_reproduce_round_trip": "torchrun + a Ray rerun",
    "tests/launch/test_ray_runs.py::test_a_hung_run_is_killed_at_its_timeout": "waits out a hung run's timeout",
    # SIGKILL/resume loops: test_cli_search.py's sqlite case stays default
    "tests/search/test_cli_search.py::test_resume_after_sigkill_at_several_points[journal]": "SIGKILL loop",
    "tests/search/test_cli_search.py::test_two_concurrent_searches_share_one_study": "two CLI processes",
    # PostgreSQL: test_storage.py's single-outage case and the claims tests stay default
    "tests/search/test_status.py::test_status_watch_waits_out_a_database_outage": "a PostgreSQL restart (19 s)",
    "tests/search/test_status.py::test_ctrl_c_during_an_outage_ends_the_watch": "a 12 s PostgreSQL outage",
    "tests/search/test_storage.py::test_past_the_window_an_outage_is_one_line": "a PostgreSQL outage (8 s)",
    # narrow locks: test_locks.py's sqlite case (four processes, two studies) and the in-process scopes stay default
    "tests/search/test_locks.py::test_a_study_writer_does_not_wait_on_another_studys_lock[journal]": "4 processes",
    "tests/search/test_locks.py::test_a_study_writer_does_not_wait_on_another_studys_lock[postgresql]": "4 processes",
    # torchrun: test_harness_cli.py::test_torchrun stays default
    "tests/launch/test_export_cli.py::test_exported_torchrun_command_runs_the_harness": "an exported run.sh run",
    "tests/search/test_multifidelity.py::test_workers_on_one_study_measure_each_plan_once": "worker processes",
    "tests/search/test_multifidelity.py::test_a_killed_workers_claim_is_taken_over": "SIGKILLed worker process",
    # the slowest default cases at the end of issue 22-26's round (771 s quiet for the default suite): each kind
    # keeps its other cases in the default suite
    "tests/test_bad_input.py::test_disk_full_calibrate_keeps_the_previous_calibration":
        "a real CPU calibration under a full disk (23 s; test_failed_calibrate_keeps_the_previous_file stays)",
    "tests/test_bad_input.py::test_clean_reaps_a_killed_ray_session": "starts and kills a Ray session (21 s)",
    "tests/search/test_multifidelity.py::test_refit_starts_from_the_given_calibration_and_can_be_off":
        "three real-run loops with refits (17 s; tests/search/test_calibrate.py keeps the refit rules)",
    "tests/search/test_multifidelity.py::test_infra_failure_is_retried_not_stored_as_the_plans_verdict":
        "a real-run loop with infra failures (15 s; test_run_order.py keeps the retry rule)",
    "tests/search/test_storage.py::test_a_full_disk_under_a_sqlite_storage_is_one_line_and_the_search_resumes":
        "a search on a full disk, resumed (15 s; test_bad_input.py keeps the disk-full report case)",
    "tests/search/test_run_order.py::test_the_last_runs_settle_a_ranking_within_noise":
        "a noisy real-run loop (15 s; test_run_noise.py keeps K and the re-measurements)",
    "tests/search/test_session.py::test_one_set_of_repredicted_trials_per_calibration": "two real-run loops (12 s)",
    "tests/launch/test_export_parsers.py::test_no_plan_field_is_dropped_silently[torchrun]":
        "exports every plan field to torchrun (17 s; the other targets stay)",
    # the default suite past 10 minutes on CI (686 s): four more of the slowest cases, each kind keeping others
    "tests/launch/test_harness_expert_sharding.py::test_traced_expert_states_equal_the_analytic_model[pp=2,":
        "ZeRO-2 experts under a 2-stage pipeline, traced (34 s at load; five layouts stay)",
    "tests/launch/test_harness_expert_sharding.py::test_traced_expert_states_equal_the_analytic_model[dp=4,tp=2,ep=2,etp=2":
        "experts split on (ep, etp) then FSDP, traced (19 s at load)",
    "tests/launch/test_trace.py::test_zero3_states_shrink_as_one_over_dp":
        "traces dp=8 and dp=32 (22 s at load; test_zero0_peak_independent_of_world_size stays)",
    "tests/launch/test_trace.py::test_traced_equals_measured[pp=2,dp=2,zero=2,schedule=1f1b]":
        "traces a 2-stage pipeline (16 s at load; the other two measured plans stay)",
    "tests/test_user_paths.py::test_a_capacity_planners_path_agrees_with_explain_and_the_reverse_question[deepseek-v3":
        "DeepSeek-V3 capacity at 128 and 256 nodes screens 400,000 plans (about 80 s of CPU)",
    "tests/search/test_user_path_demo.py":
        "demo -> status -> report -> reproduce -> resume through the real CLI (real runs)",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the INTEGRATION suites (by node-id prefix) with `integration`."""
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in INTEGRATION):
            item.add_marker(pytest.mark.integration)
