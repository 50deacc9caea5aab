package cudaipc_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
)

func TestNotExportableError(t *testing.T) {
	err := error(&cudaipc.NotExportableError{Ptr: 0x7f0000000000, Allocator: "memory of a stream-ordered pool (cudaMallocAsync) without an IPC handle type", Fix: cudaipc.FixPool})
	if !errors.Is(err, cudaipc.ErrNotExportable) || strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), "expandable_segments:True") {
		t.Fatalf("%v", err)
	}
}
