from controller.client.cli import main

raise SystemExit(main())
