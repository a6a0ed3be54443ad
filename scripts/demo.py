"""The README's start command: runs what exists of the system and says so.

Filled in as the daemons land: it will start a control plane on a folder
store, join one machine with the echo runtime, and prompt an agent.
"""

from __future__ import annotations

import sys


def main() -> int:
    print("agents platform: the daemons have not landed yet; nothing to start.")
    print("Run ./scripts/test to run the foundation's tests.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
