package store_test

import (
	"context"
	"errors"
	"log"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"github.com/cudaipc/cudaipc/store"
)

// A daemon: serve until SIGINT or SIGTERM, with metrics on loopback.
func ExampleStore_ListenAndServe() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	s, err := store.New(store.Config{
		Capacity: 4 << 30,
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, nil)),
	})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	go http.ListenAndServe("127.0.0.1:9464", s.MetricsHandler())

	err = s.ListenAndServe(ctx, "/run/user/1000/cudaipc/store.sock")
	if errors.Is(err, store.ErrDaemonRunning) {
		log.Fatal("another daemon serves this socket; stop it or choose another --socket")
	}
	if err != nil {
		log.Fatal(err)
	}
}
