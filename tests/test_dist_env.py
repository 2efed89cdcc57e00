import os
import subprocess
import sys

import pytest

from conftest import TINY, cli
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.base.malloc import keep_freed_memory
from multicard.runtime import environment, process_group
from multicard.runtime.environment import NodeTopology, detect_env, expand_hostlist, tasks_on_node
from multicard.runtime.process_group import select_interface
from multicard.strategy import topology


def test_plain_process_is_world_size_one():
    env = detect_env({})
    assert env.source == "none" and env.world_size == 1 and env.rank == 0 and not env.launched


def test_torchrun_variables():
    env = detect_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("torchrun", 5, 8, 1, 4)
    assert (env.node_rank, env.master_addr, env.master_port) == (1, "node0", 1234)


def test_srun_variables_with_compressed_node_list():
    env = detect_env(
        {
            "SLURM_PROCID": "6",
            "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_LOCALID": "2",
            "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (env.source, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 6, 8, 2, 4)
    assert env.node_rank == 1 and env.master_addr == "gpu07"
    assert env.master_port == environment.SLURM_DEFAULT_PORT_BASE + 4242


def test_sbatch_script_without_srun_is_one_plain_process():
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}).source == "none"


def test_torchrun_wins_over_slurm_variables():
    env = detect_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    assert env.source == "torchrun" and env.rank == 1


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[8-10],login1", ["gpu8", "gpu9", "gpu10", "login1"]),
        ("rack[1-2]-n[3]", ["rack1-n3", "rack2-n3"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("a[1-2],b[09-10,12],c", ["a1", "a2", "b09", "b10", "b12", "c"]),
        ("gpu-[1-2].cluster", ["gpu-1.cluster", "gpu-2.cluster"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("spec, node, count", [("8", 0, 8), ("2(x4)", 3, 2), ("4(x2),3", 1, 4), ("4(x2),3", 2, 3)])
def test_tasks_per_node_lists(spec, node, count):
    assert tasks_on_node(spec, node) == count


def test_bad_tasks_per_node_list_is_a_user_error():
    with pytest.raises(UserError, match="4x2"):
        tasks_on_node("4x2", 0)


SRUN = {"SLURM_JOB_ID": "7", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "11"}


def test_srun_uneven_tasks_per_node_gives_each_node_its_count():
    env = {**SRUN, "SLURM_PROCID": "8", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
           "SLURM_STEP_NODELIST": "node[01-04,07]"}  # fmt: skip
    got = detect_env(env)
    assert (got.rank, got.node_rank, got.local_world_size, got.master_addr) == (8, 2, 3, "node01")


def test_srun_falls_back_to_the_job_variables_and_honours_master_overrides():
    env = {**SRUN, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "6(x2)",
           "SLURM_JOB_NODELIST": "gpu-a[3-4]", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}  # fmt: skip
    got = detect_env(env)
    assert (got.local_world_size, got.master_addr, got.master_port) == (6, "10.1.2.3", 29400)
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    assert detect_env(env).master_addr == "gpu-a3"


def test_socket_ifname_sets_gloo_and_nccl_unless_exported():
    environ: dict[str, str] = {}
    select_interface("lo", environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    select_interface("lo", environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}  # the exported one wins
    select_interface(None, environ)  # unset: nothing changes


def test_unknown_socket_ifname_lists_the_interfaces():
    with pytest.raises(UserError, match=r"net.socket_ifname=lo,nosuch0: nosuch0 is not .*\blo\b"):
        select_interface("lo,nosuch0", {})


def test_bad_variable_is_a_user_error():
    with pytest.raises(UserError, match="RANK"):
        detect_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_nproc_larger_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(process_group, "cuda_count", lambda: 2)
    cfg = load_config(None, ["train.global_batch_size=64", "strategy=ddp"])
    with pytest.raises(UserError, match="lower --nproc-per-node to 2"):
        topology.resolve(cfg, world_size=4, local_world_size=4, launched=True)
    assert topology.resolve(cfg, world_size=2, local_world_size=2, launched=True).gpus == [0, 1]


def test_more_gpus_than_exist_is_refused(monkeypatch):
    monkeypatch.setattr(process_group, "cuda_count", lambda: 2)
    cfg = load_config(None, ["devices=[0,3]", "strategy=single"])
    with pytest.raises(UserError, match="only 2 GPU"):
        topology.resolve(cfg, 1, 1, launched=False)


def test_dp_batch_must_split_over_its_gpus(monkeypatch):
    monkeypatch.setattr(process_group, "cuda_count", lambda: 3)
    cfg = load_config(None, ["train.global_batch_size=64", "strategy=dp"])
    with pytest.raises(UserError, match="multiple of 3"):
        topology.resolve(cfg, 1, 1, launched=False)


def test_single_strategy_refuses_several_processes():
    env = detect_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(UserError, match="use strategy=ddp"):
        topology.resolve_strategy("single", env.launched, env.world_size)
    assert topology.resolve_strategy("auto", env.launched, env.world_size) == "ddp"
    plain = detect_env({})
    assert topology.resolve_strategy("auto", plain.launched, plain.world_size) == "single"


def test_cloud_launchers_describe_the_node_in_their_variables():
    """A Kubeflow TrainJob (PET_*: torchrun's own variables) or a SkyPilot task (SKYPILOT_*) runs one
    `multicard train` per node: multicard's launcher takes the topology from them."""
    from multicard.runtime.environment import node_topology

    kubeflow = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "trainjob-node-0-0", "PET_MASTER_PORT": "29400"}  # fmt: skip
    assert node_topology(kubeflow) == NodeTopology("kubeflow", 4, 2, 1, "trainjob-node-0-0", 29400)
    assert node_topology({**kubeflow, "PET_NPROC_PER_NODE": "auto"}).nproc_per_node is None  # one per GPU
    sky = {"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2",
           "SKYPILOT_NUM_GPUS_PER_NODE": "8"}  # fmt: skip
    assert node_topology(sky) == NodeTopology("skypilot", 8, 2, 0, "10.0.0.5", 29400)
    assert node_topology({}) is None


def test_an_elastic_pytorchjob_names_a_rendezvous_endpoint_and_a_range_of_nodes():
    """An elastic PyTorchJob (elasticPolicy) gives every node the same variables: MIN:MAX nodes, the
    c10d endpoint (no node rank: torch's agent finds the node that hosts it), restarts and settings."""
    from multicard.runtime.environment import node_topology

    job = {"PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "8", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ID": "job",
           "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_MAX_RESTARTS": "10",
           "PET_RDZV_CONF": "last_call_timeout=5"}  # fmt: skip
    expected = NodeTopology("kubeflow", 8, 4, None, "job-worker-0", 23456, 1, 10, "last_call_timeout=5")
    assert node_topology(job) == expected
    assert node_topology({**job, "PET_RDZV_ENDPOINT": "job-worker-0"}).master_port == 29400  # torchrun's c10d default
    assert node_topology({**job, "PET_NNODES": "2"}).min_nodes is None  # a fixed size
    with pytest.raises(UserError, match="PET_NNODES '4:1': need 1 <= MIN <= MAX"):
        node_topology({**job, "PET_NNODES": "4:1"})


def test_workers_of_an_elastic_job_know_every_world_size_it_may_run_at():
    """multicard's launcher tells them MIN:MAX (MULTICARD_NNODES): a script's Run checks its batch at each."""
    env = detect_env({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MULTICARD_NNODES": "1:3"})
    assert env.world_sizes == [2, 4, 6]
    assert detect_env({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).world_sizes == [4]


def test_folders_of_agents_that_no_longer_run_are_removed(tmp_path, monkeypatch):
    """An agent's folder (a node's progress and copies of checkpoints) outlives a launcher killed by
    SIGKILL; the next launcher or worker on the node removes it, and keeps those of running agents."""
    monkeypatch.setattr(environment.tempfile, "tempdir", str(tmp_path))
    mine = environment.agent_folder(os.getpid())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = environment.agent_folder(os.getpid()).with_name(f"multicard-agent-{dead.pid}-1")
    for folder in (mine, gone):
        (folder / "checkpoints").mkdir(parents=True)
    environment.remove_stale_agent_folders()
    assert mine.exists() and not gone.exists()


def test_workers_key_the_agents_store_by_restart_only_where_the_agent_keeps_it():
    """torch's agent shares its store with the workers unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (which
    multicard's launcher sets for restartable jobs): only the shared one outlives a restart."""
    shared = detect_env({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert shared.agent_store and not detect_env({"RANK": "0", "WORLD_SIZE": "2"}).agent_store


@pytest.mark.slow
@pytest.mark.distributed
def test_a_trainjob_node_starts_its_workers_from_the_pet_variables(tmp_path):
    env = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1"}
    result = cli("train", *TINY, "train.max_steps=2", f"out_dir={tmp_path}", env=env)
    assert result.returncode == 0, result.stderr
    assert "strategy=ddp world_size=2" in result.stdout


CHURN = """
import ctypes, os
from multicard.base.malloc import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def given_back():  # what freeing 128 MiB of 8 MiB blocks (a step's gradients) returns to the system
    blocks = [libc.malloc(8 << 20) for _ in range(16)]
    for b in blocks:
        ctypes.memset(b, 1, 8 << 20)
    before = resident()
    for b in blocks:
        libc.free(b)
    return before - resident()
print(given_back(), keep_freed_memory(), given_back(), given_back())
"""


def test_cpu_training_keeps_freed_memory_for_the_next_step():
    """glibc gives freed blocks back at once (to be faulted in again at the next step); after
    keep_freed_memory, what a step frees stays for the next."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, env=env, check=True).stdout
    default, kept, *after = out.split()
    assert int(default) > 100 << 20 and kept == "True"
    assert all(int(back) < 8 << 20 for back in after), out


def test_an_allocator_the_user_chose_is_left_alone():
    assert not keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not keep_freed_memory({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})


def test_gloo_timeouts_are_stalls_whatever_their_wording():
    from multicard.base.errors import ExitCode
    from multicard.runtime.exits import communication_failure

    assert communication_failure(RuntimeError("Application timeout caused pair closure")) == ExitCode.STALLED
    assert communication_failure(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")) == (
        ExitCode.PEER_LOST
    )
    assert communication_failure(RuntimeError("CUDA out of memory")) is None
