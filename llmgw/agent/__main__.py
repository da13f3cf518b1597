import sys

from llmgw.agent import main

sys.exit(main())
