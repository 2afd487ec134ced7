import pytest

from stratagem.spaces import Scenario, cluster_preset, model_preset


@pytest.fixture
def llama8b() -> Scenario:
    return Scenario(
        model=model_preset("llama3-8b"),
        cluster=cluster_preset("h100-sxm-80g", 8),
        training={"seq_len": 8192, "global_batch_size": 64},
    )


# CI (.ci/run sets STRATAGEM_STRICT_SKIPS=1) fails when a test skips for any reason but a missing optional package:
# a fresh clone has its reference data, Chromium and PostgreSQL (installed by `make test` as root), so a skip
# there means a check silently did not run.
OPTIONAL_PACKAGES = ("deepspeed",)


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
