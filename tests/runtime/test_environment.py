"""Launch-context detection and settings (no processes started)."""

import os

import pytest

from hasten import environment
from hasten.errors import ConfigError, DistributedSetupError


def test_plain_process(monkeypatch):
    assert environment.detect_launch().source == "none"


def test_torchrun_variables(monkeypatch):
    for k, v in dict(
        RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234"
    ).items():
        monkeypatch.setenv(k, v)
    info = environment.detect_launch()
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("torchrun", 3, 4, 1, 2)
    assert (info.master_addr, info.master_port, info.node_rank, info.num_nodes) == ("10.0.0.1", 1234, 1, 2)


def test_open_mpi_variables(monkeypatch):
    for k, v in dict(
        OMPI_COMM_WORLD_RANK="1",
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    ).items():
        monkeypatch.setenv(k, v)
    info = environment.detect_launch()
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("mpi", 1, 2, 1)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 29500)


def test_mpich_pmi_variables(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("MPI_LOCALRANKID", "0")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    info = environment.detect_launch()
    assert (info.source, info.rank, info.world_size, info.local_world_size) == ("mpi", 0, 2, 2)


def test_mpi_across_machines_needs_master_addr(monkeypatch):
    for k, v in dict(
        OMPI_COMM_WORLD_RANK="2",
        OMPI_COMM_WORLD_SIZE="4",
        OMPI_COMM_WORLD_LOCAL_RANK="0",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    ).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedSetupError, match="MASTER_ADDR"):
        environment.detect_launch()


def test_slurm_job_step(monkeypatch):
    for k, v in dict(
        SLURM_PROCID="3",
        SLURM_NTASKS="4",
        SLURM_LOCALID="1",
        SLURM_STEP_ID="0",
        SLURM_NODEID="1",
        SLURM_STEP_TASKS_PER_NODE="2(x2)",
        SLURM_STEP_NODELIST="gpu[07-08]",
        SLURM_JOB_ID="4242",
    ).items():
        monkeypatch.setenv(k, v)
    info = environment.detect_launch()
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 3, 4, 1, 2)
    assert info.master_addr == "gpu07" and info.master_port == 20000 + 4242


def test_slurm_batch_script_is_a_single_process(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert environment.detect_launch().source == "none"


def test_torchrun_wins_inside_slurm(monkeypatch):
    for k, v in dict(
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
        SLURM_STEP_ID="0",
        RANK="1",
        WORLD_SIZE="2",
        MASTER_ADDR="h",
        MASTER_PORT="1",
    ).items():
        monkeypatch.setenv(k, v)
    assert environment.detect_launch().source == "torchrun"


def test_slurm_nodelist():
    assert environment.parse_slurm_nodelist("a[01-03,07],b5,c[9]") == ["a01", "a02", "a03", "a07", "b5", "c9"]


def test_settings_prefer_hasten_over_accelerate(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert environment.get_str("MIXED_PRECISION") == "fp16"
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "bf16")
    assert environment.get_str("MIXED_PRECISION") == "bf16"
    assert environment.setting_source("MIXED_PRECISION") == "HASTEN_MIXED_PRECISION"


def test_bad_setting_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("HASTEN_DEBUG_MODE", "maybe")
    with pytest.raises(ConfigError, match="HASTEN_DEBUG_MODE='maybe' is not a boolean"):
        environment.get_flag("DEBUG_MODE")
    monkeypatch.setenv("HASTEN_GRADIENT_ACCUMULATION_STEPS", "two")
    with pytest.raises(ConfigError, match="HASTEN_GRADIENT_ACCUMULATION_STEPS='two' is not an integer"):
        environment.get_int("GRADIENT_ACCUMULATION_STEPS")


def test_unlisted_setting_is_a_programming_error():
    with pytest.raises(KeyError, match="not listed"):
        environment.get_str("NOT_A_SETTING")


def test_fsdp_bare_alias(monkeypatch):
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
    assert environment.get_str("FSDP_SHARDING_STRATEGY") == "FULL_SHARD"


def test_config_home_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("HASTEN_HOME", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert environment.config_home() == tmp_path / "xdg" / "huggingface" / "hasten"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert environment.config_home() == tmp_path / "hf" / "hasten"
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "own"))
    assert environment.default_config_file() == tmp_path / "own" / "default_config.yaml"


def test_old_kernel_logs_once_on_accelerates_logger_under_the_alias(monkeypatch, caplog):
    monkeypatch.setattr("hasten.environment.system.kernel_version", lambda: (4, 19))
    monkeypatch.setattr("hasten.environment.system._kernel_warned", False)
    import hasten.accelerate_alias as alias

    monkeypatch.setattr(alias, "is_installed", lambda: False)
    with caplog.at_level("WARNING"):
        environment.check_os_kernel()
        environment.check_os_kernel()
    assert [(r.name, r.levelname) for r in caplog.records] == [("hasten.utils.environment", "WARNING")]
    assert "older than the minimum recommended 5.5.0" in caplog.records[0].msg
    monkeypatch.setattr(alias, "is_installed", lambda: True)
    assert alias.logger_for("utils.environment").name == "accelerate.utils.environment"


def test_patch_environment_restores(monkeypatch):
    monkeypatch.setenv("KEEP", "1")
    with environment.patch_environment(keep="2", new_one=3):
        import os

        assert os.environ["KEEP"] == "2" and os.environ["NEW_ONE"] == "3"
    import os

    assert os.environ["KEEP"] == "1" and "NEW_ONE" not in os.environ


def test_a_launch_environment_is_one_class_and_one_entry(monkeypatch):
    from hasten.environment import launch

    class ToyLauncher(launch.LaunchEnvironment):
        name = "toy"
        prepared: list = []

        @classmethod
        def detect(cls):
            return "TOY_RANK" in os.environ

        def world_size(self):
            return 4

        def rank(self):
            return int(os.environ["TOY_RANK"])

        def local_rank(self):
            return self.rank() % 2

        def local_world_size(self):
            return 2

        def prepare_rendezvous(self, info):
            self.prepared.append(info)

    monkeypatch.setattr(launch, "DETECTION_ORDER", (ToyLauncher, *launch.DETECTION_ORDER))
    assert environment.detect_launch().source == "none", "a launcher is only asked for what it detects"
    monkeypatch.setenv("TOY_RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    info = environment.detect_launch()
    assert (info.source, info.rank, info.world_size, info.local_rank, info.node_rank, info.num_nodes) == (
        "toy",
        3,
        4,
        1,
        1,
        2,
    )
    assert (info.master_addr, info.master_port) == ("10.0.0.9", None)
    environment.prepare_rendezvous(info)
    assert ToyLauncher.prepared == [info]


def test_detection_order_ends_with_the_process_alone():
    from hasten.environment import launch

    names = [kind.name for kind in launch.DETECTION_ORDER]
    assert names == ["torchrun", "mpi", "slurm", "none"]
    assert len(set(names)) == len(names)


def test_mpi_and_slurm_write_torchs_variables_before_the_rendezvous(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    environment.prepare_rendezvous(environment.detect_launch())
    written = [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")]
    assert written == ["1", "2", "1", "127.0.0.1", "29500"]


def test_ranks_by_hand_without_master_addr_cannot_meet(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    info = environment.detect_launch()
    with pytest.raises(DistributedSetupError, match="MASTER_ADDR is not"):
        environment.prepare_rendezvous(info)
