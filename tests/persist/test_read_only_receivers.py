"""ro52, as the user nobody (root writes read-only files): a read-only directory under an
in-place rewrite is an error naming the file, the cause and the fix (a bare "Permission
denied" naming a temporary before); a file-backed leaf unpickled after its file was made
read-only maps read-only, as a load does, and a write to it says why (its unpickle failed
with a MappingError before)."""
from tests.processes import run_as_nobody


def test_read_only_directory_and_unpickled_read_only_file_messages():
    run_as_nobody("""
        import gc, pickle, numpy as np, torch, shared_td
        from shared_td import TensorDict

        def warm(base):
            w = os.path.join(base, "warm")
            TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w)
            TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w, existsok=True)
            pickle.loads(pickle.dumps(TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w + "2")))

        def check(base):
            p = os.path.join(base, "save")
            # 1: a nested directory the rewrite cannot create its meta.json temporary in
            TensorDict(a=torch.ones(4), n=TensorDict(b=torch.ones(4), batch_size=[4]), batch_size=[4]).memmap_(p)
            os.chmod(os.path.join(p, "n"), 0o555)
            try:
                TensorDict(a=torch.full((4,), 2.0), n=TensorDict(b=torch.full((4,), 2.0), batch_size=[4]),
                           batch_size=[4]).memmap_(p, existsok=True)
                msg = "no error"
            except PermissionError as e:
                msg = str(e)
            first = np.fromfile(os.path.join(p, "a.memmap"), dtype=np.float32).tolist()
            print(msg, first, flush=True)
            ok = "n/meta.json" in msg and "writable" in msg and "atomic=True" in msg and first == [1.0] * 4
            os.chmod(os.path.join(p, "n"), 0o755)
            # 2: a leaf pickled while writable, unpickled once its file is read-only
            t = shared_td.load_memmap(p)["a"]
            os.chmod(os.path.join(p, "a.memmap"), 0o444)
            blob = pickle.dumps(t)
            del t
            gc.collect()  # (this process's cached mapping would be reused)
            received = pickle.loads(blob)
            readable = received.tolist() == [1.0] * 4
            try:
                received.add_(1); msg2 = "no error"
            except shared_td.ReadOnlyError as e:
                msg2 = str(e)
            print(readable, msg2, flush=True)
            return ok and readable and "a.memmap" in msg2 and "permission to write" in msg2
    """)
