package client_test

import (
	"context"
	"crypto/rand"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

const fakeGPU = "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"

func init() {
	// Leases the latest version of NAME (not mapping it), says its version
	// and sources table size, holds until killed.
	fastRoles["nocopy-holder"] = func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		l, err := c.GetWith(ctx, os.Getenv("NAME"), client.GetOptions{Wait: true})
		if err != nil {
			return err
		}
		say("holding %d %d", l.Info().Version, l.Info().SourcesSize)
		<-ctx.Done()
		return nil
	}
}

// publishFake publishes a no-copy version of name over made-up legacy
// regions of the given sizes, one tensor in each; it returns the version
// and its manifest.
func publishFake(t *testing.T, c *client.Client, name string, sizes ...int64) (uint64, *bundle.Manifest) {
	t.Helper()
	u, _ := cudaipc.ParseUUID(fakeGPU)
	starts, span, err := bundle.SourceStarts(sizes)
	if err != nil {
		t.Fatal(err)
	}
	m := &bundle.Manifest{}
	var enc [][]byte
	for i, n := range sizes {
		r := cudaipc.Region{Version: cudaipc.RegionVersion, Kind: cudaipc.KindCUDAIPC, Size: n, AllocSize: n, Device: u,
			ExporterPID: os.Getpid(), PIDNamespace: 4026531836, BootID: cudaipc.BootID{1}, BufferID: 7, ExporterBase: 0x7f0000000000}
		rand.Read(r.Handle[:])
		b, err := r.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		enc = append(enc, b)
		m.Tensors = append(m.Tensors, bundle.Tensor{Name: string(rune('a' + i)), DType: bundle.U8, Shape: []int64{n}, Begin: starts[i], End: starts[i] + n})
	}
	v, err := client.PublishSources(c, context.Background(), name, m.Marshal(), bundle.EncodeSources(enc), nil, span, fakeGPU, client.CreateOptions{KeepLast: 1})
	if err != nil {
		t.Fatal(err)
	}
	return v, m
}

// A no-copy version reaches a Go reader with its manifest and sources
// table; WaitReleased waits for the readers (real processes, killed with
// -9 one by one) and names how many still hold it.
func TestNoCopyWaitReleased(t *testing.T) {
	sock := socketPath(t)
	startDaemon(t, sock)
	pub := dial(t, sock)
	v, m := publishFake(t, pub, "policy", 1<<20, 3<<20)

	rd := dial(t, sock)
	l, err := rd.GetWith(context.Background(), "policy", client.GetOptions{Version: v})
	if err != nil {
		t.Fatal(err)
	}
	if in := l.Info(); in.SourcesSize == 0 || !in.External || !in.ExporterBound {
		t.Fatalf("info %+v", in)
	}
	got, err := l.Manifest()
	if err != nil || len(got.Tensors) != len(m.Tensors) || got.Tensors[1].Begin != m.Tensors[1].Begin || got.Tensors[1].Name != m.Tensors[1].Name {
		t.Fatalf("manifest %+v (%v), want %+v", got, err, m)
	}
	if _, err := l.Sources(); err == nil {
		t.Fatal("made-up legacy regions mapped")
	}
	if _, err := l.ReadAt(make([]byte, 8), 0); !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "Sources") {
		t.Fatalf("ReadAt of a no-copy version: %v, want ErrInvalid naming Sources", err)
	}
	l.Release()

	holders := []*proc{}
	for range 2 {
		h := spawn(t, "nocopy-holder", nil, "CUDAIPC_SOCKET="+sock, "NAME=policy")
		h.expect("holding")
		holders = append(holders, h)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_, err = pub.WaitReleased(ctx, "policy")
	cancel()
	if !errors.Is(err, client.ErrTimeout) || !strings.Contains(err.Error(), "2 readers still hold 2 leases") {
		t.Fatalf("WaitReleased = %v, want ErrTimeout naming 2 readers", err)
	}
	if _, err := rd.GetWith(context.Background(), "policy", client.GetOptions{Version: v}); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get of a withdrawn version: %v, want ErrNotFound", err)
	}
	holders[0].kill9()
	testutil.Eventually(t, testutil.Wait, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		_, err := pub.WaitReleased(ctx, "policy")
		if err == nil || !strings.Contains(err.Error(), "1 readers still hold 1 leases") {
			return errors.New("not yet one reader: " + errString(err))
		}
		return nil
	})
	holders[1].kill9()
	ctx, cancel = context.WithTimeout(context.Background(), testutil.Wait)
	defer cancel()
	if _, err := pub.WaitReleased(ctx, "policy"); err != nil {
		t.Fatal(err)
	}
	v2, _ := publishFake(t, pub, "policy", 1<<20)
	if v2 <= v {
		t.Fatalf("version %d after %d", v2, v)
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
