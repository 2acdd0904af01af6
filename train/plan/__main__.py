"""`python -m train.plan`: the layout planner's command line (train/plan/planner.py)."""

import sys

from train.plan.planner import main

sys.exit(main())
