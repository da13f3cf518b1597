"""`python -m llmgw.router`: router-only mode (see llmgw/router/_main.py)."""

import sys

from llmgw.router._main import main

sys.exit(main())
