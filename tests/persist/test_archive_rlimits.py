"""Archives loaded, written, packed and unpacked under lowered limits (real limits, in a child)."""
import os
import subprocess
import sys
import textwrap

import shared_td

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shared_td.__file__)))  # (the package the tests import)


def test_compressed_member_refused_by_rlimit_as_is_a_mapping_error_naming_it(tmp_path):
    code = textwrap.dedent(f"""
        import errno, resource, torch, shared_td
        p = {str(tmp_path / "x.tdz")!r}
        shared_td.TensorDict(a=torch.ones(4, 1 << 18), batch_size=[4]).memmap(p, compression="deflate")
        new = shared_td.TensorDict(a=torch.full((4, 1 << 18), 2.0), batch_size=[4])
        vm = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        for what in ("load", "write"):
            resource.setrlimit(resource.RLIMIT_AS, (vm() + (3 << 20), hard))
            try:
                shared_td.load_memmap(p) if what == "load" else new.memmap(p, compression="deflate", existsok=True)
                print(what, "OK")
            except OSError as e:
                assert isinstance(e, shared_td.MappingError) and e.errno == errno.ENOMEM, repr(e)
                assert "'a.memmap'" in str(e) and "RLIMIT_AS" in str(e), e
                if what == "write":
                    assert "written completely" in " ".join(getattr(e, "__notes__", [])), e
                print(what, "ERR")
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert float(shared_td.load_memmap(p)["a"][0, 0]) in (1.0, 2.0)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "load ERR" in proc.stdout, proc.stdout


def test_archive_write_out_of_descriptors_names_rlimit_nofile_at_every_open(tmp_path):
    code = textwrap.dedent(f"""
        import errno, os, resource, torch, shared_td
        p = {str(tmp_path / "y.tdz")!r}
        td = shared_td.TensorDict(a=torch.ones(4, 100), b=torch.zeros(4), batch_size=[4])
        td.memmap(p)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        bare = []
        for k in range(0, 12):
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + k, hard))
            try:
                td.memmap(p, existsok=True)
            except OSError as e:
                if e.errno == errno.EMFILE and "RLIMIT_NOFILE" not in str(e):
                    bare.append((k, str(e)))
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert not bare, bare
        assert (shared_td.load_memmap(p)["a"] == 1).all()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_unpack_and_pack_short_of_memory_name_rlimit_as_and_keep_the_old_tree(tmp_path):
    code = textwrap.dedent("""
        import os, sys, resource, gc, torch, shared_td
        torch.set_num_threads(1)
        d = sys.argv[1]
        A, P, S = os.path.join(d, "a.tdz"), os.path.join(d, "out"), os.path.join(d, "src")
        shared_td.TensorDict(a=torch.full((8 << 20,), 5.0), batch_size=[]).memmap(A)
        shared_td.TensorDict(a=torch.full((8 << 20,), 5.0), batch_size=[]).memmap(S)
        W, WS = os.path.join(d, "w.tdz"), os.path.join(d, "ws")
        shared_td.TensorDict(a=torch.ones(3), batch_size=[]).memmap(W)
        shared_td.TensorDict(a=torch.ones(3), batch_size=[]).memmap(WS)
        shared_td.TensorDict(a=torch.ones(3), batch_size=[]).memmap(P)
        shared_td.unpack_memmap(W, os.path.join(d, "warm")); shared_td.pack_memmap(WS, os.path.join(d, "warm.tdz"))
        gc.collect()
        def vm():
            return int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        saved = resource.getrlimit(resource.RLIMIT_AS)
        failures = 0
        for op in ("unpack", "pack"):
            for mib in range(0, 24, 2):
                resource.setrlimit(resource.RLIMIT_AS, (vm() + (mib << 20), saved[1]))
                try:
                    if op == "unpack":
                        shared_td.unpack_memmap(A, P)
                    else:
                        shared_td.pack_memmap(S, os.path.join(d, "p.tdz"))
                except (MemoryError, OSError) as e:
                    failures += 1
                    assert "RLIMIT_AS" in str(e), (op, mib, repr(e))
                finally:
                    resource.setrlimit(resource.RLIMIT_AS, saved)
                if op == "unpack":
                    t = shared_td.load_memmap(P)
                    assert t["a"].shape in ((3,), (8 << 20,)), t  # the old tree or the new one, whole
                    del t
                gc.collect()
        assert failures, "no level failed: widen the scan"
        shared_td.unpack_memmap(A, P)
        assert float(shared_td.load_memmap(P)["a"][0]) == 5.0
        print("OK", failures)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
