"""The demo's reference line names the backend that certified the reference."""

from __future__ import annotations

from mhanum import CertificationError, demo, reference

SMALL = {"seed": 0, "d_model": 16, "num_heads": 2, "length": 8}


def test_the_reference_line_names_the_double_double_enclosure_where_it_certifies():
    result = demo.run(**SMALL)
    assert result.reference_backend == "dd"
    line = demo.render(result).splitlines()[1]
    assert line.startswith(
        "reference: backend dd (double-double enclosure), certified to 20 digits"
    )
    assert line.endswith(" s wall time)")


def test_the_reference_line_names_auto_where_the_enclosure_leaves_rows(monkeypatch):
    certify = reference.multi_head_attention

    def without_dd(*args, backend="auto", **kwargs):
        if backend == "dd":
            msg = "backend 'dd' could not certify 20 digits"
            raise CertificationError(msg)
        return certify(*args, backend=backend, **kwargs)

    monkeypatch.setattr(reference, "multi_head_attention", without_dd)
    result = demo.run(**SMALL)
    assert result.reference_backend == "auto"
    assert (
        demo.render(result)
        .splitlines()[1]
        .startswith(
            "reference: backend auto (double-double enclosure, uncertified rows recomputed)"
        )
    )
