package cudaipc_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/store"
)

// A registration of more pieces than one packet carries descriptors (an
// expandable-segment-like range of 2*MaxFiles+7 granules; a 4 GiB PyTorch
// tensor spans ~205) through a daemon in this process: Register stages
// them, a reader's Get fetches them all and maps the range read-only
// through the cache, bytes equal, from inside the first piece to inside
// the last; a write through the lease fails.
func TestRegisterMorePiecesThanAPacket(t *testing.T) {
	dev := testutil.RequireGPU(t)
	st, err := store.New(store.Config{Backend: "cuda", GPUShare: "fd", Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	sock := filepath.Join(t.TempDir(), "s")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- st.ListenAndServe(ctx, sock) }()
	defer func() { cancel(); <-done }()
	dial := func() *client.Client {
		var c *client.Client
		testutil.Eventually(t, testutil.Wait, func() error {
			var err error
			c, err = client.Dial(ctx, sock)
			return err
		})
		t.Cleanup(func() { c.Close() })
		return c
	}

	const n = 2*protocol.MaxFiles + 7
	e, err := cudaipc.NewExpandableForTest(dev, n, true)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Free()
	data := testutil.RandomBytes(uint64(os.Getpid()), int(e.Size()))
	if err := dev.CopyToDevice(e.Ptr(), data); err != nil {
		t.Fatal(err)
	}
	off, size := e.Piece()/2, e.Size()-e.Piece()
	r, files, err := cudaipc.ExportPointer(dev, e.Ptr()+cudaipc.DevicePtr(off), size)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != n || len(r.Pieces()) != n || r.Version != cudaipc.RegionVersionPieces {
		t.Fatalf("%d descriptors, region %v", len(files), r)
	}
	_, err = dial().Register(ctx, "torch/big", r, files, client.RegisterOptions{Shared: true})
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	l, err := dial().Get(ctx, "torch/big")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	got := make([]byte, size)
	if _, err := l.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data[off:off+size]) {
		t.Fatal("the registered range reads other bytes than the exporter wrote")
	}
	if m := l.Mapping(); m == nil || len(m.Region().Pieces()) != n || l.Info().Region == nil || !l.Info().Region.Equal(m.Region()) {
		t.Fatalf("lease mapping %v, info region %v", m != nil, l.Info().Region)
	}
	if err := dev.Memset(l.Ptr(), 0, 4096); err == nil {
		t.Fatal("a write through the read-only lease succeeded")
	}
}
