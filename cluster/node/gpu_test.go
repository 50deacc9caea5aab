package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// GPU objects across daemons: on the GPU machine both daemons use its one
// GPU and UCX tcp on loopback, so every byte goes device → pinned host →
// UCX → pinned host → device (cluster/node/gpu.go).

func randomBytes(n int, seed byte) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{seed, byte(n), byte(n >> 8), byte(n >> 16)}).Read(b)
	return b
}

// putGPU creates a cluster-visible object of data on d's GPU gpu.
func putGPU(t *testing.T, ctx context.Context, d *daemon, name, gpu string, data []byte, opts client.CreateOptions) {
	t.Helper()
	opts.Device, opts.Cluster = gpu, true
	var o *client.Object
	var err error
	if opts.Versioned {
		o, err = d.c.Publish(ctx, name, int64(len(data)), opts)
	} else {
		o, err = d.c.Create(ctx, name, int64(len(data)), opts)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := o.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := o.Seal(ctx); err != nil {
		t.Fatal(err)
	}
}

// gpuDaemons starts etcd and two daemons, a and b, with the cuda backend
// and capacity bytes each. It returns GPU 0's UUID (the test skips without
// a GPU) and a context that ends after two minutes or with the test.
func gpuDaemons(t *testing.T, capacity int64) (gpu string, a, b *daemon, ctx context.Context) {
	t.Helper()
	gpu = testutil.RequireGPU(t).UUID().String()
	srv := etcdtest.Start(t)
	a, b = startDaemonOn(t, srv, "a", capacity, "cuda"), startDaemonOn(t, srv, "b", capacity, "cuda")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return gpu, a, b, ctx
}

// readGPU reads a lease's bytes and checks that it is GPU memory.
func readGPU(t *testing.T, l *client.Lease) []byte {
	t.Helper()
	if l.Device() == "" || l.Device() == "host" {
		t.Fatalf("lease of %s is in %q memory, want the GPU", l.Info().Name, l.Device())
	}
	b := make([]byte, l.Size())
	if _, err := l.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestGPUObjectsAcrossDaemons(t *testing.T) {
	gpu, a, b, ctx := gpuDaemons(t, 1<<30)

	// Plain objects, random bytes: many chunks with a short last one, and
	// one shorter than a chunk; their checksums computed on the device
	// (the default), then on the host (HostChecksums) for the last two.
	for i, size := range []int{96<<20 + 4097, 1000, 40<<20 + 17, 999} {
		host := i >= 2
		node.SetHostChecksums(a.node, host)
		node.SetHostChecksums(b.node, host)
		devA, hostA := node.GPUChecksummed(a.node)
		devB, hostB := node.GPUChecksummed(b.node)
		name := "w" + string(rune('0'+i))
		want := randomBytes(size, byte(i))
		putGPU(t, ctx, a, name, gpu, want, client.CreateOptions{})
		e, err := b.node.Directory().Lookup(ctx, cluster.Ref{Name: name})
		if err != nil || !e.GPU {
			t.Fatalf("record of %s: gpu %v, %v", name, e.GPU, err)
		}
		staged := node.StagedBytes(b.node)
		l, err := b.c.Get(ctx, name)
		if err != nil {
			t.Fatalf("get %s on B: %v", name, err)
		}
		got := readGPU(t, l)
		l.Release()
		if !bytes.Equal(got, want) {
			t.Fatalf("%s on B differs from A's (%d bytes)", name, size)
		}
		if d := node.StagedBytes(b.node) - staged; d != uint64(size) {
			t.Fatalf("B staged %d bytes host→device for %d", d, size)
		}
		dA, hA := node.GPUChecksummed(a.node)
		dB, hB := node.GPUChecksummed(b.node)
		sums := [4]uint64{dA - devA, hA - hostA, dB - devB, hB - hostB}
		wantSums := [4]uint64{uint64(size), 0, uint64(size), 0}
		if host {
			wantSums = [4]uint64{0, uint64(size), 0, uint64(size)}
		}
		if sums != wantSums {
			t.Fatalf("%s: bytes checksummed on A's device, A's host, B's device, B's host: %v, want %v", name, sums, wantSums)
		}
	}
	node.SetHostChecksums(a.node, false)
	node.SetHostChecksums(b.node, false)

	// A bundle of several tensors on the GPU.
	tensors := tensorsOf(t, 10,
		bundle.Spec{Name: "embed", DType: bundle.F32, Shape: []int64{1000, 700}},
		bundle.Spec{Name: "layer.0.w", DType: bundle.BF16, Shape: []int64{3, 5, 7}},
		bundle.Spec{Name: "head", DType: bundle.U8, Shape: []int64{9 << 20}})
	if _, err := a.c.PutBundle(ctx, "model", tensors, map[string]string{"format": "pt"}, client.CreateOptions{Cluster: true, Device: gpu}); err != nil {
		t.Fatal(err)
	}
	l, m, err := b.c.GetBundle(ctx, "model", client.GetOptions{})
	if err != nil {
		t.Fatalf("bundle get on B: %v", err)
	}
	whole := readGPU(t, l)
	l.Release()
	if m.Metadata["format"] != "pt" {
		t.Fatalf("B's manifest: %+v", m)
	}
	checkTensors(t, "B's GPU replica", whole, m, tensors, tensorNames(tensors)...)

	// Versions: B waits for a version newer than the one it has, A
	// publishes it.
	v1 := randomBytes(8<<20+3, 20)
	putGPU(t, ctx, a, "policy", gpu, v1, client.CreateOptions{Versioned: true, KeepLast: 2})
	l, err = b.c.GetWith(ctx, "policy", client.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ver1 := l.Info().Version
	if got := readGPU(t, l); !bytes.Equal(got, v1) {
		t.Fatal("policy v1 on B differs from A's")
	}
	l.Release()
	type result struct {
		l   *client.Lease
		err error
	}
	res := make(chan result, 1)
	go func() {
		l, err := b.c.GetWith(ctx, "policy", client.GetOptions{NewerThan: ver1, Wait: true})
		res <- result{l, err}
	}()
	v2 := randomBytes(8<<20+5, 21)
	putGPU(t, ctx, a, "policy", gpu, v2, client.CreateOptions{Versioned: true, KeepLast: 2})
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatalf("newer than v%d on B: %v", ver1, r.err)
		}
		if r.l.Info().Version <= ver1 {
			t.Fatalf("newer than v%d on B: v%d", ver1, r.l.Info().Version)
		}
		got := readGPU(t, r.l)
		r.l.Release()
		if !bytes.Equal(got, v2) {
			t.Fatal("policy v2 on B differs from A's")
		}
	case <-time.After(time.Minute):
		t.Fatal("B's get newer_than did not return")
	}
	// B's replica of v2 is a holder like A's original.
	testutil.Eventually(t, testutil.Wait, func() error {
		e, err := a.node.Directory().Lookup(ctx, cluster.Ref{Name: "policy", Version: ver1 + 1})
		if err != nil {
			return err
		}
		if len(e.Holders) != 2 {
			return errors.New("B is not a holder of policy v2 yet: " + strings.Join(e.Holders, ","))
		}
		return nil
	})
}

// A reader whose GPU is full gets STORE_FULL naming its node and device.
func TestGPUReplicaStoreFull(t *testing.T) {
	dev := testutil.RequireGPU(t)
	gpu := dev.UUID().String()
	srv := etcdtest.Start(t)
	a, small := startDaemonOn(t, srv, "a", 1<<30, "cuda"), startDaemonOn(t, srv, "small", 32<<20, "cuda")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	putGPU(t, ctx, a, "big", gpu, randomBytes(48<<20, 3), client.CreateOptions{})
	_, err := small.c.Get(ctx, "big")
	if !errors.Is(err, client.ErrStoreFull) {
		t.Fatalf("get of a 48 MiB GPU object on a 32 MiB daemon: %v, want STORE_FULL", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "node small") || !strings.Contains(msg, gpu) {
		t.Fatalf("STORE_FULL does not name the reader's node and GPU: %v", err)
	}
	if _, err := small.c.Stat(ctx, "big"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("stat on the small daemon after the failed pull: %v", err)
	}
}

// A reader that goes mid-pull (its client's connection closed, which ends
// the get's pull) leaves no pin on the holder, no exposure held, and no
// replica.
func TestGPUReaderGoneMidPull(t *testing.T) {
	gpu, a, b, ctx := gpuDaemons(t, 4<<30)
	const size = 3 << 30 // ~3 s over UCX tcp on loopback
	putGPU(t, ctx, a, "victim", gpu, randomBytes(size, 9), client.CreateOptions{})
	rc, err := client.Dial(ctx, b.sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		l, err := rc.Get(ctx, "victim")
		if err == nil {
			l.Release()
		}
		done <- err
	}()
	// Once bytes flow (A staged the object and B read some), the reader
	// goes.
	testutil.Eventually(t, testutil.Wait, func() error {
		if b.node.Stats().Pulls > 0 {
			t.Fatal("the pull ended before the reader went: the object is too small for this link")
		}
		if node.StagedBytes(a.node) < size || b.node.Stats().InFlight != 1 || node.StagedBytes(b.node) == 0 {
			return errors.New("the pull has not started moving bytes")
		}
		return nil
	})
	rc.Close()
	<-done
	testutil.Eventually(t, testutil.Wait, func() error {
		if st := b.node.Stats(); st.InFlight != 0 || st.Failed != 1 {
			return errors.New("B's pull still running or not failed")
		}
		n, err := a.node.Directory().Pinned(ctx, cluster.Ref{Name: "victim"})
		if err != nil {
			return err
		}
		if n != 0 || node.PinsHeld(a.node) != 0 {
			return errors.New("A still pinned for B")
		}
		return nil
	})
	if _, err := b.c.Stat(ctx, "victim"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("B kept something of the abandoned pull: %v", err)
	}
}

// TestGPUPublishedBeforeStaged: a GPU object's record goes out before its
// staging device→host ends (slowed down here): A's seal returns while the
// staging runs, B's pull starts on the first slices, its fetches of the
// rest wait at A and are answered as the slices land, and B gets every
// byte right. A staging that fails mid-way fails B's pull (no replica);
// a later get stages the object anew and succeeds.
func TestGPUPublishedBeforeStaged(t *testing.T) {
	gpu, a, b, ctx := gpuDaemons(t, 2<<30)

	const size = 640<<20 + 4097 // 11 slices of 64 MiB
	// The staging stops before its third slice until B's fetches wait for
	// it (B pulls slower than A stages: unheld, B may never catch up).
	var slices atomic.Int64
	unhold := holdStaging(t, a.node, 2*64<<20, nil, &slices)
	want := randomBytes(size, 31)
	putGPU(t, ctx, a, "early", gpu, want, client.CreateOptions{})
	if n, s := node.Filling(a.node), slices.Load(); n != 1 || s >= 11 {
		t.Fatalf("after the seal returned: %d objects staging on A, %d slices staged; want 1 still staging", n, s)
	}
	deferred := node.FetchesDeferred(a.node)
	type result struct {
		got []byte
		err error
	}
	res := make(chan result, 1)
	go func() {
		l, err := b.c.Get(ctx, "early")
		if err != nil {
			res <- result{nil, err}
			return
		}
		got := readGPU(t, l)
		l.Release()
		res <- result{got, nil}
	}()
	awaitDeferred(t, a.node, deferred)
	unhold()
	r := testutil.Next(t, res, time.Minute)
	if r.err != nil {
		t.Fatalf("get on B: %v", r.err)
	}
	if !bytes.Equal(r.got, want) {
		t.Fatal("B's replica differs from A's object")
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := node.Filling(a.node); n != 0 {
			return fmt.Errorf("%d objects still staging on A", n)
		}
		return nil
	})

	// A staging that fails at its fourth slice, once B's fetches wait
	// for it: they are refused and B's get fails, naming A and why, with
	// no replica on B; a later get has A stage the object anew (not
	// behind its record: the failed staging is gone) and gets every byte.
	release := holdStaging(t, a.node, 3*64<<20, errors.New("injected staging failure"), nil)
	want2 := randomBytes(size, 32)
	putGPU(t, ctx, a, "early-bad", gpu, want2, client.CreateOptions{})
	refused := node.FetchesRefused(a.node)
	deferred = node.FetchesDeferred(a.node)
	errc := make(chan error, 1)
	go func() {
		l, err := b.c.Get(ctx, "early-bad")
		if err == nil {
			l.Release()
		}
		errc <- err
	}()
	awaitDeferred(t, a.node, deferred)
	release()
	err := testutil.Next(t, errc, time.Minute)
	node.HookStaging(a.node, nil)
	if err == nil || !strings.Contains(err.Error(), "node a") || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("B's get while A's staging failed: %v, want a failure naming node a's refusal", err)
	}
	if node.FetchesRefused(a.node) == refused {
		t.Fatal("A's failed staging refused no fetch")
	}
	if b.st.Replicas().Has(0, "early-bad", 0, 0) {
		t.Fatal("B kept a replica of a failed pull")
	}
	l, err := b.c.Get(ctx, "early-bad")
	if err != nil {
		t.Fatalf("B's get after A's failed staging: %v", err)
	}
	got := readGPU(t, l)
	l.Release()
	if !bytes.Equal(got, want2) {
		t.Fatal("B's replica after A's failed staging differs from A's object")
	}
}

// holdStaging makes n's stagings behind published records stop before the
// slice at off until release (called by the test, or at its end, so that
// a failed test leaves no staging stopped), then fail with fail (nil: go
// on); slices, when set, counts the slices begun.
func holdStaging(t *testing.T, n *node.Node, off int64, fail error, slices *atomic.Int64) (release func()) {
	held := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	node.HookStaging(n, func(o int64) error {
		if slices != nil {
			slices.Add(1)
		}
		if o >= off {
			<-held
			return fail
		}
		return nil
	})
	return release
}

// awaitDeferred waits until a fetch of n's peers has waited for bytes
// being staged since n counted since of them.
func awaitDeferred(t *testing.T, n *node.Node, since uint64) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		if node.FetchesDeferred(n) == since {
			return errors.New("no fetch waits for the staging yet")
		}
		return nil
	})
}
