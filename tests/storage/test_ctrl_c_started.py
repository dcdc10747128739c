"""A Ctrl-C landing as in_flight.started() returns (run_in_background records the write,
then is interrupted before its try) must not leave the write recorded: its future is never
set, and the program's exit waited for it forever (inject43)."""
import subprocess
import sys
import textwrap

CODE = textwrap.dedent('''
    import tempfile, torch, shared_td
    from shared_td.persist import in_flight
    real = in_flight.started
    def started_then_ctrl_c(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt  # a SIGINT handled right after the call returned
    in_flight.started = started_then_ctrl_c
    td = shared_td.TensorDict(a=torch.ones(3), batch_size=[3])
    try:
        td.memmap_(tempfile.mkdtemp(), num_threads=2, return_early=True)
    except KeyboardInterrupt:
        pass
    in_flight.started = real
    print(len(in_flight._running), td.is_locked)
''')


def test_a_ctrl_c_as_a_background_write_is_recorded_leaves_no_record_and_exit_ends():
    try:
        done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as hang:
        raise AssertionError(f"the program's exit hung: {hang.stdout!r}") from None
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False"]
