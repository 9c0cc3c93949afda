from deltafuse.cli import main

raise SystemExit(main())
