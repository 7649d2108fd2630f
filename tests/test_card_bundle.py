"""tools/card_bundle.py: what a lent GPU machine is sent beside the checkout so that gpu-check runs
there (its image lacks bitsandbytes, DeepSpeed, torchao and the notebook stack). The download and
the xz archive need the package registry; what decides their content is tested here."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("card_bundle", ROOT / "tools" / "card_bundle.py")
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)


def test_the_closure_stops_at_the_image_and_torch_and_follows_markers_for_the_cards_python():
    graph = {
        "app": ["lib-a>=1", "torch>=2", "old-only; python_version < '3.12'", "devtool; extra == 'dev'",
                "Image_Pkg", "transformers"],
        "lib-a": ["lib_b", "newer-only; python_version >= '3.12'"],
        "lib-b": [], "old-only": [], "newer-only": [], "devtool": [],
        "image-pkg": ["behind-image"], "behind-image": [],  # the image's own version brings its own
        "transformers": ["image-pkg"],
    }
    image = {"image-pkg", "transformers"}
    requires = graph.get  # None: not installed here (a root may be: taken without requirements)
    assert cb.carried(["app", "not-installed"], image, "3.12", requires) == [
        "app", "lib-a", "lib-b", "newer-only", "not-installed", "transformers"]
    assert cb.carried(["app"], image, "3.11", requires) == ["app", "lib-a", "lib-b", "old-only", "transformers"]


def test_this_checkouts_bundle_holds_what_gpu_check_imports_and_not_what_the_card_has():
    names = set(cb.carried(cb.project_roots() + list(cb.EXTRA), cb.image_packages(), "3.12"))
    assert {"bitsandbytes", "deepspeed", "torchao", "papermill", "ipykernel", "nbclient", "plotly", "ipywidgets",
            "dask", "distributed", "transformers", "peft", "pydantic"} <= names
    # the card's own CUDA torch and its numpy stay; so do the image's tokenizers and hub
    assert not names & {"torch", "numpy", "tokenizers", "huggingface-hub", "accelerate", "triton", "jupyterlab",
                        "voila", "litgpt"}


def test_prune_keeps_the_cards_cuda_library_and_the_cpus(tmp_path):
    bnb = tmp_path / "bitsandbytes"
    (bnb / "__pycache__").mkdir(parents=True)
    (bnb / "__pycache__" / "x.pyc").write_bytes(b"0" * 10)
    for name in ("cuda118", "cuda130", "cuda132", "rocm64", "xpu2026", "cpu"):
        (bnb / f"libbitsandbytes_{name}.so").write_bytes(b"0" * 100)
    (bnb / "functional.py").write_text("")
    removed = cb.prune(tmp_path, "130")
    assert sorted(p.name for p in bnb.iterdir()) == ["functional.py", "libbitsandbytes_cpu.so",
                                                      "libbitsandbytes_cuda130.so"]
    assert removed == 4 * 100 + 10


def test_a_bundle_over_what_a_call_carries_keeps_the_one_before(tmp_path, monkeypatch):
    """The size was checked after the new archive had replaced the old one: a working bundle was gone,
    and one no device call could carry was left in its place."""
    import os

    import pytest

    def pip(*args):  # the site a build installs: bytes that xz cannot shrink
        if args[0] == "install":
            site = Path(args[args.index("--target") + 1])
            site.mkdir(parents=True)
            (site / "blob").write_bytes(os.urandom(20_000))

    monkeypatch.setattr(cb, "carried", lambda *a, **k: ["somepkg"])
    monkeypatch.setattr(cb, "_pip", pip)
    monkeypatch.setattr(cb, "LIMIT_BYTES", 10_000)
    out = tmp_path / ".whl" / "site.tar.xz"
    out.parent.mkdir()
    out.write_bytes(b"the bundle that fits")
    with pytest.raises(SystemExit, match="over the 0 MiB a device call can spare: carry less \\(the earlier bundle is kept\\)"):
        cb.build(out, "3.12", "130")
    assert out.read_bytes() == b"the bundle that fits" and sorted(p.name for p in out.parent.iterdir()) == ["site.tar.xz"]
    monkeypatch.setattr(cb, "LIMIT_BYTES", 10**6)
    assert cb.build(out, "3.12", "130") == out and out.stat().st_size > 20_000  # under the limit: replaced
