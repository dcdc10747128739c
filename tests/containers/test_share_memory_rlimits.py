"""share_memory_() out of file descriptors (a real RLIMIT_NOFILE, in a child): torch
keeps one descriptor open per shared tensor, and its bare RuntimeError named neither the
key nor the limit (limits20)."""
import os
import subprocess
import sys
import textwrap

import shared_td

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shared_td.__file__)))


def test_share_memory_out_of_descriptors_names_the_key_and_the_limit_and_completes_once_freed():
    code = textwrap.dedent("""
        import errno, gc, os, resource, torch
        from shared_td import NonTensorData, TensorDict
        TensorDict(a=torch.zeros(2), s=NonTensorData("w"), batch_size=[2]).share_memory_()  # (warm)
        gc.collect()
        td = TensorDict({"s": NonTensorData("hi"),
                         "inner": {f"k{i}": torch.full((4,), float(i)) for i in range(8)}}, batch_size=[4])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        try:
            td.share_memory_()
            raise SystemExit("no error")
        except OSError as error:
            caught = error
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert caught.errno == errno.EMFILE, repr(caught)
        assert "('inner', 'k" in str(caught) and "RLIMIT_NOFILE" in str(caught), caught
        assert not td.is_shared() and not td.is_locked
        td.share_memory_()
        assert td.is_shared() and td.is_locked
        assert td["inner", "k7"].tolist() == [7.0] * 4 and td["s"] == "hi"
        print("OK")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr[-3000:]
