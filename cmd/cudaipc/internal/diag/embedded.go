package diag

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"

	"github.com/cudaipc/cudaipc/store"
)

// embeddedStore is a store served in this process on a socket in a private
// temporary directory, for demo and bench: no daemon to start.
type embeddedStore struct {
	socket string
	dir    string
	st     *store.Store
	cancel context.CancelFunc
	done   chan error
}

// startEmbedded starts a store with the auto backend; gpuShare is its
// Config.GPUShare ("" for the default).
func startEmbedded(ctx context.Context, e *Env, capacity int64, gpuShare string) (*embeddedStore, error) {
	log := e.Log
	if e.LogLevel == "info" {
		// The store logs every connection at info; the demo's own output
		// says what happens.
		log = slog.New(slog.NewTextHandler(e.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	st, err := store.New(store.Config{Backend: "auto", GPUShare: gpuShare, Capacity: capacity, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("starting the embedded store: %w", err)
	}
	dir, err := os.MkdirTemp("", "cudaipc-embedded-")
	if err != nil {
		st.Close()
		return nil, err
	}
	sock := filepath.Join(dir, "store.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		st.Close()
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting the embedded store: %w", err)
	}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	emb := &embeddedStore{socket: sock, dir: dir, st: st, cancel: cancel, done: make(chan error, 1)}
	go func() { emb.done <- st.Serve(sctx, l) }()
	return emb, nil
}

// Close stops serving, closes the store and removes the socket directory.
func (e *embeddedStore) Close() error {
	e.cancel()
	err := <-e.done
	if cerr := e.st.Close(); err == nil {
		err = cerr
	}
	os.RemoveAll(e.dir)
	return err
}

// benchStore is the store a benchmark talks to: the daemon at e.Socket, or,
// when none is given, an embedded one of the given capacity. It returns the
// socket, what the result's "store" field says ("embedded" or the socket)
// and a function that stops an embedded store (nothing for a given one).
func benchStore(ctx context.Context, e *Env, capacity int64) (sock, label string, stop func(), err error) {
	if e.Socket != "" {
		return e.Socket, e.Socket, func() {}, nil
	}
	emb, err := startEmbedded(ctx, e, capacity, "")
	if err != nil {
		return "", "", nil, err
	}
	return emb.socket, "embedded", func() { emb.Close() }, nil
}
