"""The variables every worker gets (driver/starts.py): the pure parts."""

from __future__ import annotations

import os

from lightning_elastic.launcher.driver.starts import AUTOLOAD_DIR, worker_pythonpath


def test_the_autoload_folder_comes_first_before_the_given_pythonpath():
    assert worker_pythonpath(os.pathsep.join(["/mine", "/other"])) == os.pathsep.join(
        [str(AUTOLOAD_DIR), "/mine", "/other"])


def test_no_pythonpath_or_an_empty_one_is_the_autoload_folder_alone():
    assert worker_pythonpath(None) == str(AUTOLOAD_DIR)
    assert worker_pythonpath("") == str(AUTOLOAD_DIR)  # -x PYTHONPATH= : nothing of the user's


def test_a_pythonpath_that_holds_the_autoload_folder_has_it_once_and_first():
    # -x PYTHONPATH forwards the driver's, which may carry the folder already (a nested launch).
    given = os.pathsep.join(["/mine", str(AUTOLOAD_DIR), "", "/other"])
    assert worker_pythonpath(given) == os.pathsep.join([str(AUTOLOAD_DIR), "/mine", "/other"])
