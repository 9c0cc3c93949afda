from deltafuse.bench.cli import main

raise SystemExit(main())
