"""``python -m rdmaflow.fileview MOUNTPOINT --model DECL.json``, the same as ``rdmaflow mount``,
and what every process of a file-view job runs: ``rdmaflow launch ... -m rdmaflow.fileview
MOUNTPOINT --model DECL.json`` (or torchrun with this file, ``rdmaflow.fileview.SCRIPT``)."""
import argparse
import sys

from rdmaflow.fileview import mount

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="rdmaflow mount", description=mount.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mount.add_arguments(parser)
    sys.exit(mount.run(parser.parse_args()))
