package store

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// TestSealAs: an object created under one name and sealed under another
// is found, with its bytes and the seal's descriptor, under the new name
// only; waiters of the new name wake; a taken name is EXISTS and leaves the
// object unsealed under its own name; bundles are refused.
func TestSealAs(t *testing.T) {
	s := newTestStore(t, Config{})
	w, r, q := connect(t, s, 1000), connect(t, s, 1000), connect(t, s, 1000)
	p, err := w.ss.createTyped(".ahead-1", 5000, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{5000}})
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(5000)
	copy(w.mapping(p), data)
	woke := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		p, err := q.ss.getName(ctx, "final", true)
		p.closeShare()
		woke <- err
	}()
	desc := &storev1.TensorDesc{Dtype: "float32", Shape: []int64{1250}}
	if err := w.ss.sealAs(".ahead-1", "final", desc); err != nil {
		t.Fatal(err)
	}
	if err := <-woke; err != nil {
		t.Fatalf("a get waiting for the new name: %v", err)
	}
	_, got := r.get("final")
	if !bytes.Equal(got, data) {
		t.Fatal("the renamed object does not hold its bytes")
	}
	in, err := r.ss.stat("final")
	if err != nil || !in.Sealed || in.Tensor.GetDtype() != "float32" || in.Name != "final" {
		t.Fatalf("stat of the new name: %+v, %v", in, err)
	}
	if _, err := r.ss.stat(".ahead-1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the old name after the rename: %v, want NOT_FOUND", err)
	}
	// A taken name: EXISTS, and the object stays a draft under its name.
	if _, err := w.ss.createObject(".ahead-2", 100, "", false); err != nil {
		t.Fatal(err)
	}
	if err := w.ss.sealAs(".ahead-2", "final", nil); !errors.Is(err, ErrExists) {
		t.Fatalf("sealing under a taken name: %v, want EXISTS", err)
	}
	if err := w.ss.sealAs(".ahead-2", "final2", &storev1.TensorDesc{Dtype: "float32", Shape: []int64{1000}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a descriptor larger than the object: %v, want INVALID", err)
	}
	if err := w.ss.abortName(".ahead-2"); err != nil {
		t.Fatalf("the draft after a refused rename: %v", err)
	}
	// Only the creator's drafts.
	if _, err := w.ss.createObject(".ahead-3", 100, "", false); err != nil {
		t.Fatal(err)
	}
	if err := r.ss.sealAs(".ahead-3", "stolen", nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("another connection sealing the draft: %v, want NOT_FOUND", err)
	}
	if err := w.ss.sealAs("final", "again", nil); !errors.Is(err, ErrSealed) {
		t.Fatalf("renaming a sealed object: %v, want SEALED", err)
	}
}

// TestServerSealRenameAndWaitEvent, through a socket: seal with rename
// qualifies the new name in the caller's namespace (another uid's is
// PERMISSION); a wait_event of the wrong size is INVALID, and one the
// daemon cannot open (here: no GPU driver, or an event of no process) is
// INVALID saying "wait_event", the object left unsealed for a plain seal.
func TestServerSealRenameAndWaitEvent(t *testing.T) {
	if cudaipc.EventDescriptorBinarySize != 124 {
		t.Fatalf("protocol's event descriptor size is 124, cudaipc's %d", cudaipc.EventDescriptorBinarySize)
	}
	_, path, _ := serve(t, Config{})
	c := dialRaw(t, path)
	resp, files := c.do(req(&storev1.CreateRequest{Name: ".ahead", Size: 4096}))
	wantCode(t, resp, storev1.Error_OK)
	data := randomBytes(4096)
	copy(c.mapping(resp.GetCreate().GetPlacement(), files), data)
	resp, _ = c.do(req(&storev1.SealRequest{Name: ".ahead", Rename: "4242:theirs"}))
	wantCode(t, resp, storev1.Error_PERMISSION)
	resp, _ = c.do(req(&storev1.SealRequest{Name: ".ahead", Rename: "mine", WaitEvent: []byte("short")}))
	wantCode(t, resp, storev1.Error_INVALID)
	var ev cudaipc.EventDescriptor
	ev.Version = cudaipc.RegionVersion
	ev.Handle[0], ev.Device[0], ev.ExporterPID, ev.PIDNamespace, ev.BootID[0] = 1, 1, 1, 1, 1
	blob, err := ev.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	resp, _ = c.do(req(&storev1.SealRequest{Name: ".ahead", Rename: "mine", WaitEvent: blob}))
	wantCode(t, resp, storev1.Error_INVALID)
	if !strings.HasPrefix(resp.GetError().GetMessage(), "wait_event: ") {
		t.Fatalf("message %q, want it to start with \"wait_event: \"", resp.GetError().GetMessage())
	}
	resp, _ = c.do(req(&storev1.SealRequest{Name: ".ahead", Rename: "mine"}))
	wantCode(t, resp, storev1.Error_OK)
	resp, files = c.do(req(&storev1.GetRequest{Name: "mine"}))
	wantCode(t, resp, storev1.Error_OK)
	if !bytes.Equal(c.mapping(resp.GetGet().GetPlacement(), files), data) {
		t.Fatal("the object sealed under its new name does not hold its bytes")
	}
}

func (ss *session) createTyped(name string, size int64, tensor *storev1.TensorDesc) (placement, error) {
	p, _, err := ss.create(createReq{name: name, size: size, tensor: tensor})
	return p, err
}

// sealAs seals the draft name under to, with tensor if not nil.
func (ss *session) sealAs(name, to string, tensor *storev1.TensorDesc) error {
	r := sealReq{name: name, rename: to, tensor: tensor}
	if to == name {
		r.rename = ""
	}
	return ss.seal(r)
}
