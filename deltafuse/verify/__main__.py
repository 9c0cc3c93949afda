"""`python -m deltafuse.verify ARGS`: the same as `deltafuse verify ARGS`."""

from deltafuse.verify import main

raise SystemExit(main())
