"""Shared pytest set-up: keep TensorFlow off accelerators and quiet, run JAX on the host CPU,
one JAX compilation cache for the session, and the longest test files first."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On GPUs (JAX_PLATFORMS=cuda) float32 matrix products default to TF32 (a 10-bit mantissa),
# which the tests' float32 tolerances against float64 and PyTorch references do not allow.
if os.environ["JAX_PLATFORMS"] != "cpu":
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# LLVM at -O0 for the tests' tiny models: XLA compiles about 30% faster (measured: one Barlow
# Twins end-to-end test, 42.5 s -> 29.9 s of CPU) and their steps take milliseconds either
# way. Subprocesses inherit it (their launchers append to XLA_FLAGS, never replace it).
# Compilation dominates the suite's time; JSSL_TEST_XLA_OPT=1 keeps XLA's default level.
# LLVM's expensive passes off as well: about 10% less compile time again.
if os.environ.get("JSSL_TEST_XLA_OPT") != "1":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    ).strip()

import pytest  # noqa: E402

# Files that take minutes (subprocess runs on 1, 2 and 4 devices). They are collected first,
# so that under pytest-xdist (``-n 2 --dist loadfile``) the other worker runs the rest
# meanwhile instead of one worker running them alone at the end.
LONGEST_FIRST = (
    "test_parallel.py",
    "test_contract.py",
    "test_contract_runs.py",
    "test_multihost_train.py",
    "test_launch.py",
    "test_package.py",
    "test_verify.py",
    "test_finite_update.py",
)


# The tiers beyond the README's test command: marker -> the variable that runs its tests.
TIERS = {
    # Whole engine runs in subprocesses, and one computation compared across device or process
    # counts (resume, preemption, multi-host, sharding, accumulation): .ci/run runs them after
    # the default tier.
    "e2e": "JSSL_E2E_TESTS",
    # Minutes each: every demo run to its goal, and runs whose property a CI test holds.
    "slow": "JSSL_SLOW_TESTS",
}


def pytest_collection_modifyitems(config, items):
    """Tests of a tier (``e2e``, ``slow``) run only with its variable set to 1, so that the
    default suite is a contributor's loop (under 10 minutes on 2 cores); the LONGEST_FIRST
    files go first."""

    def rank(item) -> int:
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside each file and among the rest is kept
    for marker, variable in TIERS.items():
        if os.environ.get(variable) == "1":
            continue
        skip = pytest.mark.skip(reason=f"{marker} tier: set {variable}=1 to run")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _session_compilation_cache(tmp_path_factory):
    """Every in-process test reads and writes the session's compilation cache (a step that
    one test compiled is loaded, not compiled again, by the next test that builds it)."""
    from support.launch import enable_compilation_cache, shared_cache_dir

    enable_compilation_cache(str(shared_cache_dir(tmp_path_factory)))


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory):
    """(demo data dir, compilation cache dir) shared by every test of the session."""
    from support.launch import prepare_shared_dirs

    return prepare_shared_dirs(tmp_path_factory)
