"""A worker that never connected to its coordinator (nothing warmed) attaches under a
real RLIMIT_AS: whatever refuses the mapping, the segment, the manager's version table
or the slab of shared values, is a MappingError naming it and the limit (the table's
was a bare "OSError: cannot map 32768 bytes of descriptor 13"; limits21). The workers
are forked by a script of its own, each bounded."""
import os
import subprocess
import sys
import textwrap

import shared_td

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shared_td.__file__)))

SCRIPT = """
import gc, multiprocessing as mp, os, resource, torch, shared_td
from shared_td import NonTensorData, TensorDict
torch.set_num_threads(1)

def vmsize():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))

def work(coord, step, answers):
    gc.collect()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vmsize() + step * 65536, hard))
    try:
        view = coord.attach("anon")
        value = view["s"]
        answer = "ok"
    except shared_td.MappingError as error:
        answer = "named" if "RLIMIT_AS" in str(error) else "unnamed: " + str(error)
    except Exception as error:
        answer = f"{type(error).__name__}: {error}"
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    answers.put(answer)

def publish(coord):
    tree = TensorDict(k0=torch.ones(256, 1024), s=NonTensorData("v"), batch_size=[256])
    coord.publish("anon", tree, share_non_tensor=True)

if __name__ == "__main__":
    fork = mp.get_context("fork")
    with shared_td.Coordinator() as coord:
        publisher = fork.Process(target=publish, args=(coord,))  # (this process maps nothing of it)
        publisher.start()
        publisher.join(60)
        assert publisher.exitcode == 0, publisher.exitcode
        for step in range(0, 80, 4):
            answers = fork.Queue()
            worker = fork.Process(target=work, args=(coord, step, answers))
            worker.start()
            print(step, answers.get(timeout=60), flush=True)
            worker.join(30)
"""


def test_a_cold_worker_refused_memory_by_rlimit_as_names_what_and_the_limit(tmp_path):
    script = tmp_path / "cold_worker.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    answers = [line.split(" ", 1)[1] for line in done.stdout.splitlines()]
    assert set(answers) <= {"ok", "named"}, done.stdout
    assert "named" in answers and "ok" in answers, done.stdout
