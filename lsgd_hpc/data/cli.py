"""``python -m lsgd_hpc.data {fetch,check} DATASET --root DIR``: stage CIFAR-10 on a login node
with internet, and check a staged data set before a long job."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from lsgd_hpc.data.cifar10_files import (CIFAR10_FOLDER, FETCH_HINT, cifar_root,
                                         verify_cifar10_md5)
from lsgd_hpc.data.errors import DataError
from lsgd_hpc.data.loaders import DATASETS, check_data_dir, load_dataset

__all__ = ["main"]


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage block
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _fail(msg: str, code: int = 2) -> int:
    print(f"lsgd_hpc.data: error: {' '.join(str(msg).split())}", file=sys.stderr)
    return code


def _cmd_fetch(args) -> int:
    root = os.path.abspath(os.path.expanduser(args.root))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        return _fail(f"cannot create --root {root}: {e.strerror or e}")
    try:
        from torchvision.datasets import CIFAR10
        CIFAR10(root=root, train=True, download=True)
    except Exception as e:  # noqa: BLE001 - any network/IO failure is one line, exit 1
        msg = " ".join(str(e).split()) or type(e).__name__
        return _fail(f"downloading CIFAR-10 into {root} failed ({type(e).__name__}: {msg}); "
                     f"fetch needs internet: run it on a login node", 1)
    bad = verify_cifar10_md5(root)
    if bad:
        return _fail(f"downloaded CIFAR-10 in {root} fails its md5 check: {', '.join(bad)}; "
                     f"delete {os.path.join(root, CIFAR10_FOLDER)} and fetch again", 1)
    ds = load_dataset("cifar10", root)
    print(f"cifar10 staged in {root}: {ds.n_train} train, {ds.n_test} test images, "
          f"{ds.num_classes} classes, md5 ok; train with --dataset cifar10 --data-dir {root}")
    return 0


def _cmd_check(args) -> int:
    if args.dataset == "cifar10":
        if args.root is None:
            return _fail("check cifar10 needs --root DIR (the folder holding cifar-10-batches-py/)")
        root = cifar_root(args.root)
        check_data_dir("cifar10", root, option="--root")
        ds = load_dataset("cifar10", root)
        if args.no_md5:
            md5 = "md5 not checked"
        else:
            bad = verify_cifar10_md5(root)
            if bad:
                return _fail(f"CIFAR-10 in {root} loads, but {', '.join(bad)} differ from the "
                             f"published files (md5); re-stage it with "
                             f"{FETCH_HINT.format(root=root)}, or pass --no-md5 for a hand-made "
                             f"folder")
            md5 = "md5 ok"
        where = f" in {root}"
    elif args.dataset == "imagefolder":
        if args.root is None:
            return _fail("check imagefolder needs --root DIR (the folder holding train/ and val/)")
        from lsgd_hpc.data.imagefolder import unreadable_images
        check_data_dir("imagefolder", args.root, option="--root")
        ds = load_dataset("imagefolder", args.root)
        bad = unreadable_images(ds)
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            return _fail(f"{len(bad)} of {ds.n_train + ds.n_test} images in {ds.root} do not "
                         f"decode: {'; '.join(bad[:3])}{more}")
        md5, where = "every image decodes", f" in {ds.root}"
    else:
        ds = load_dataset(args.dataset)
        md5, where = "built in", ""
    print(f"{ds.name}{where}: {ds.n_train} train, {ds.n_test} test images, {ds.num_classes} "
          f"classes, shape {'x'.join(map(str, ds.input_shape))}, {md5}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lsgd_hpc.data {fetch,check} DATASET --root DIR``; returns the exit status."""
    parser = _OneLineParser(prog="python -m lsgd_hpc.data",
                            description="Stage and check the data sets of lsgd_hpc.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    p = sub.add_parser("fetch", help="download CIFAR-10 (needs internet: run on a login node), "
                                     "then verify its md5 sums")
    p.add_argument("dataset", choices=["cifar10"])
    p.add_argument("--root", required=True, help="folder that will hold cifar-10-batches-py/")
    p = sub.add_parser("check", help="verify a staged data set and print its sizes")
    p.add_argument("dataset", choices=list(DATASETS))
    p.add_argument("--root", help="folder holding cifar-10-batches-py/ (cifar10), or train/ "
                                  "and val/ (imagefolder: every image is decoded once)")
    p.add_argument("--no-md5", action="store_true",
                   help="skip the md5 comparison with the published CIFAR-10 files")
    args = parser.parse_args(argv)
    try:
        return _cmd_fetch(args) if args.command == "fetch" else _cmd_check(args)
    except DataError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
