"""The temporary folders tokenized data lives in while a run uses it: locked while in use,
removed when their dataset goes, and cleared when their process died."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time

TEMP_PREFIX = "lorac-data-"
UNLOCKED_AGE = 86400    # s: a temp folder without a lock file older than this is removed


def temp_folder():
    """(folder, lock): a fresh lorac-data-* folder in the temp dir, locked while in use. Folders
    whose lock is free are removed first: their process died (kill -9, a crash). A new folder
    is locked before it appears under that name, so a live one is never taken for dead."""
    from lorac.core import locks
    for old in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(TEMP_PREFIX) + "*")):
        try:
            if not os.path.exists(os.path.join(old, ".lock")):  # made by a lorac without these locks:
                if time.time() - os.path.getmtime(old) > UNLOCKED_AGE:  # surely dead after a day
                    shutil.rmtree(old, ignore_errors=True)
                continue
            lock = locks.acquire(os.path.join(old, ".lock"), wait=False)
        except OSError:  # another user's folder, or gone meanwhile
            continue
        if lock is not None:
            remove_temp(old, lock)
    staging = tempfile.mkdtemp(prefix="." + TEMP_PREFIX)
    lock = locks.acquire(os.path.join(staging, ".lock"))
    folder = os.path.join(os.path.dirname(staging), os.path.basename(staging)[1:])
    os.rename(staging, folder)
    return folder, lock


def remove_temp(folder, lock):
    shutil.rmtree(folder, ignore_errors=True)
    if lock is not None:
        lock.release()
