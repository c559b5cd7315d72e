"""Entry point of a peer's background process: ``python -m dedloc.net.child FD``."""

import sys

if __name__ == "__main__":
    from dedloc.net.runtime import _child_main

    _child_main(int(sys.argv[1]))
