import sys

from jaxscale.sequences.cli import main

sys.exit(main())
