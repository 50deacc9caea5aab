// Command cudaipc shares GPU memory between processes on one machine: it
// reports what the driver offers (info, doctor), runs the node-local object
// store (serve) and talks to it (put, get, ls, stat, rm), dumps regions
// exported by other programs (dump), and measures (bench, demo).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/cudaipc/cudaipc/cmd/cudaipc/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, cli.Message(err))
		os.Exit(cli.ExitCode(err))
	}
}
