"""The bench's timing helpers."""
from __future__ import annotations

import os

from shared_td.bench.timing import fresh_dir


def test_two_sequences_of_fresh_directories_under_one_root_never_meet(tmp_path):
    # a full run's tree_to_files failed with FileExistsError on 'run24': the last
    # directory big_leaf's sequence handed out (kept until its next call) had that name
    first, second = fresh_dir(str(tmp_path)), fresh_dir(str(tmp_path))
    handed = [first() for _ in range(3)]
    os.makedirs(handed[-1])  # the last one stays, as a case leaves it
    for _ in range(5):
        path = second()
        assert path not in handed
        os.mkdir(path)  # a new, not yet existing directory each time
