package client_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

func init() {
	// Leases the version of NAME above SEEN, maps its sources and says the
	// SHA-256 of every tensor's bytes ("name=hash ..."), then releases.
	fastRoles["nocopy-reader"] = func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		var seen uint64
		fmt.Sscan(os.Getenv("SEEN"), &seen)
		l, m, err := c.GetBundle(ctx, os.Getenv("NAME"), client.GetOptions{Wait: true, NewerThan: seen})
		if err != nil {
			return err
		}
		defer l.Release()
		srcs, err := l.Sources()
		if err != nil {
			return err
		}
		var out []string
		for _, t := range m.Tensors {
			var s *client.Source
			for i := range srcs {
				if srcs[i].Start <= t.Begin && t.End <= srcs[i].Start+srcs[i].Region.Size {
					s = &srcs[i]
				}
			}
			if s == nil {
				return fmt.Errorf("tensor %q lies in no source", t.Name)
			}
			b := make([]byte, t.Size())
			if _, err := s.Mapping.ReadAt(b, t.Begin-s.Start); err != nil {
				return err
			}
			h := sha256.Sum256(b)
			out = append(out, t.Name+"="+hex.EncodeToString(h[:]))
		}
		say("version %d %s", l.Info().Version, strings.Join(out, " "))
		return nil
	}
}

// Tensors in two cudaMalloc allocations of this process are published
// without a copy; a reader process maps one region per allocation and
// reads every tensor's bytes as written; the next version, after
// WaitReleased, reads the new bytes.
func TestNoCopyPublishGPU(t *testing.T) {
	dev := testutil.RequireGPU(t)
	sock := socketPath(t)
	startDaemon(t, sock, "BACKEND=cuda")
	c := dial(t, sock)
	var bufs []*cudaipc.Buffer
	for range 2 {
		b, err := dev.Alloc(4 << 20)
		if err != nil {
			t.Fatal(err)
		}
		defer b.Free()
		bufs = append(bufs, b)
	}
	tensors := []client.NoCopyTensor{
		{Spec: bundle.Spec{Name: "a", DType: bundle.BF16, Shape: []int64{1000, 3}}, Ptr: bufs[0].Ptr() + 4096},
		{Spec: bundle.Spec{Name: "b", DType: bundle.U8, Shape: []int64{77}}, Ptr: bufs[0].Ptr() + 1<<20},
		{Spec: bundle.Spec{Name: "c", DType: bundle.F32, Shape: []int64{256, 256}}, Ptr: bufs[1].Ptr()},
	}
	seen := "0"
	for v := 1; v <= 2; v++ {
		if _, err := c.WaitReleased(context.Background(), "policy"); err != nil {
			t.Fatal(err)
		}
		want := map[string]string{}
		for _, x := range tensors {
			n, _ := bundle.ByteSize(x.DType, x.Shape)
			b := make([]byte, n)
			rand.Read(b)
			if err := dev.CopyToDevice(x.Ptr, b); err != nil {
				t.Fatal(err)
			}
			h := sha256.Sum256(b)
			want[x.Name] = hex.EncodeToString(h[:])
		}
		ver, err := c.PublishNoCopy(context.Background(), "policy", dev, tensors, map[string]string{"step": fmt.Sprint(v)}, client.CreateOptions{KeepLast: 1})
		if err != nil {
			t.Fatal(err)
		}
		r := spawn(t, "nocopy-reader", nil, "CUDAIPC_SOCKET="+sock, "NAME=policy", "SEEN="+seen)
		got := strings.Fields(r.expect("version"))
		if got[0] != fmt.Sprint(ver) {
			t.Fatalf("reader got version %s, published %d", got[0], ver)
		}
		for _, kv := range got[1:] {
			k, h, _ := strings.Cut(kv, "=")
			if want[k] != h {
				t.Fatalf("version %d: tensor %s differs", ver, k)
			}
		}
		if len(got)-1 != len(tensors) {
			t.Fatalf("reader saw %d tensors", len(got)-1)
		}
		seen = got[0]
	}
}
