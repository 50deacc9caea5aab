package cudaipc_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
)

func TestPieceLayoutValidate(t *testing.T) {
	const g = 2 << 20
	good := []cudaipc.PieceLayout{
		{Offset: 0, Size: 1, Pieces: []int64{g}},
		{Offset: g - 1, Size: 2*g + 1, Pieces: []int64{g, g, g}},
		{Offset: 10, Size: 3*g - 10, Pieces: []int64{g, 2 * g}},
	}
	for _, l := range good {
		if err := l.Validate(); err != nil {
			t.Errorf("%+v: %v", l, err)
		}
	}
	bad := map[string]cudaipc.PieceLayout{
		"pieces": {Size: 1},
		"size":   {Size: 0, Pieces: []int64{g}},
		"offset": {Offset: g, Size: 1, Pieces: []int64{g, g}},
		"past":   {Offset: 1, Size: 2 * g, Pieces: []int64{g, g}},
		"neg":    {Offset: -1, Size: 1, Pieces: []int64{g}},
		"zero":   {Size: 1, Pieces: []int64{g, 0}},
		"huge":   {Size: 1, Pieces: []int64{1 << 62, 1 << 62}},
		"many":   {Size: 1, Pieces: make([]int64, cudaipc.MaxPieces+1)},
	}
	for name, l := range bad {
		if err := l.Validate(); !errors.Is(err, cudaipc.ErrInvalidValue) {
			t.Errorf("%s: %+v: %v, want an ArgError", name, l, err)
		}
	}
}

func TestNotExportableError(t *testing.T) {
	err := error(&cudaipc.NotExportableError{Ptr: 0x7f0000000000, Allocator: "memory of a stream-ordered pool (cudaMallocAsync) without an IPC handle type", Fix: cudaipc.FixPool})
	if !errors.Is(err, cudaipc.ErrNotExportable) || strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), "expandable_segments:True") {
		t.Fatalf("%v", err)
	}
}
