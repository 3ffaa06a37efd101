from controller.client.udp_cli import main

raise SystemExit(main())
