import sys

from gputrace.cli import main

sys.exit(main())
