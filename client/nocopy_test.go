package client_test

import (
	"bytes"
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

// A no-copy version whose header and table are byte for byte those of the
// client's last one under the name is a republish (one create, sealed by
// the daemon); readers get it with the same manifest and table. Other
// bytes, or another connection, publish afresh.
func TestNoCopyRepublish(t *testing.T) {
	sock := socketPath(t)
	startDaemon(t, sock)
	pub := dial(t, sock)
	u, _ := cudaipc.ParseUUID(fakeGPU)
	sizes := []int64{1 << 20, 3 << 20}
	starts, span, err := bundle.SourceStarts(sizes)
	if err != nil {
		t.Fatal(err)
	}
	version := func(seed byte) ([]byte, []byte) {
		m := &bundle.Manifest{}
		var enc [][]byte
		for i, n := range sizes {
			r := cudaipc.Region{Version: cudaipc.RegionVersion, Kind: cudaipc.KindCUDAIPC, Size: n, AllocSize: n, Device: u,
				ExporterPID: os.Getpid(), PIDNamespace: 4026531836, BootID: cudaipc.BootID{1}, BufferID: 7, ExporterBase: 0x7f0000000000}
			r.Handle[0], r.Handle[1] = seed, byte(i)
			b, err := r.MarshalBinary()
			if err != nil {
				t.Fatal(err)
			}
			enc = append(enc, b)
			m.Tensors = append(m.Tensors, bundle.Tensor{Name: string(rune('a' + i)), DType: bundle.U8, Shape: []int64{n}, Begin: starts[i], End: starts[i] + n})
		}
		return m.Marshal(), bundle.EncodeSources(enc)
	}
	send := func(c *client.Client, h, tb []byte) uint64 {
		t.Helper()
		v, err := client.PublishSources(c, context.Background(), "policy", h, tb, nil, span, fakeGPU, client.CreateOptions{KeepLast: 1})
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	rd := dial(t, sock)
	read := func(v uint64) []byte {
		t.Helper()
		l, err := rd.GetWith(context.Background(), "policy", client.GetOptions{Version: v})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release()
		m, err := l.Manifest()
		if err != nil {
			t.Fatal(err)
		}
		return m.Marshal()
	}
	h1, t1 := version(1)
	h2, t2 := version(2)
	v1 := send(pub, h1, t1)
	v2 := send(pub, h1, t1)
	if n := client.Republished(pub); n != 1 || v2 != v1+1 {
		t.Fatalf("republished %d times, version %d after %d: want once, the next", n, v2, v1)
	}
	if got := read(v2); !bytes.Equal(got, h1) {
		t.Fatal("the republished version's manifest is not the first one's")
	}
	v3 := send(pub, h2, t2) // other regions: afresh
	v4 := send(pub, h2, t2)
	if got := read(v4); !bytes.Equal(got, h2) {
		t.Fatal("the second republished version's manifest is not its model's")
	}
	other := dial(t, sock)
	v5 := send(other, h2, t2) // another connection: afresh
	if n, m := client.Republished(pub), client.Republished(other); n != 2 || m != 0 || v4 != v3+1 || v5 != v4+1 {
		t.Fatalf("republished %d and %d times, versions %d %d %d: want 2 and 0, consecutive", n, m, v3, v4, v5)
	}
}
