"""`python -m dslab.cli ...` is the `dslab` command (the Makefile uses it before the console script exists)."""
import sys

from dslab.cli import main

sys.exit(main())
