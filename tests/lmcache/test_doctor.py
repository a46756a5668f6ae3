"""``maru doctor`` reports LMCache's version and whether Maru's backend loads."""

from __future__ import annotations

import pytest

from maru.cli import doctor
from tests.lmcache.conftest import NEEDS, WHY


def test_doctor_reports_the_lmcache_version_and_that_the_backend_loads():
    pytest.importorskip(NEEDS, reason=WHY)
    from importlib import metadata

    r = doctor.check_lmcache(doctor.DoctorContext(quick=False))
    assert r.status == doctor.OK, r.detail
    assert metadata.version("lmcache") in r.detail and "loads" in r.detail


def test_doctor_quick_names_the_version_without_importing():
    r = doctor.check_lmcache(doctor.DoctorContext(quick=True))
    assert r.status == doctor.SKIP
    assert "lmcache" in r.detail.lower()
