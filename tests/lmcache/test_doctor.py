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


def test_measured_wrong_lmcache_and_vllm_releases_are_named_and_later_ones_are_not():
    from maru.lmcache.compat import known_wrong_outputs

    for lmc, vllm in (("0.5.3", "0.26.0"), ("0.5.6", "0.26.0+cu130"), ("0.5.6", "0.32.0")):
        why = known_wrong_outputs(lmc, vllm)
        assert why and lmc in why and "MaruKVConnector" in why and "docs/lmcache.md" in why
    for lmc, vllm in (
        ("0.5.7", "0.26.0"),
        ("0.6.0", "0.26.0"),
        ("0.3.12", "0.26.0"),  # not measured serving (it does not load beside torch 2.11)
        ("0.5.6", "0.25.1"),
        (None, "0.26.0"),
        ("0.5.6", None),
        ("dev", "x"),
    ):
        assert known_wrong_outputs(lmc, vllm) is None, (lmc, vllm)
