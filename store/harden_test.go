package store

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

// logBuffer collects a store's logs for a test.
type logBuffer struct{ testutil.SyncBuffer }

func (b *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// TestServeLogsRealPath: the daemon binds under a temporary name and
// renames; its log must name the path clients use.
func TestServeLogsRealPath(t *testing.T) {
	var logs logBuffer
	s := newTestStore(t, Config{Logger: logs.logger()})
	path := filepath.Join(shortTempDir(t), "store.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.ListenAndServe(ctx, path) }()
	testutil.Eventually(t, testutil.Wait, func() error {
		if !strings.Contains(logs.String(), "msg=serving") {
			return fmt.Errorf("no msg=serving in the log:\n%s", logs.String())
		}
		return nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	if strings.Contains(out, ".tmp") || !strings.Contains(out, "msg=serving path="+path+" ") {
		t.Fatalf("log does not name %s:\n%s", path, out)
	}
}
