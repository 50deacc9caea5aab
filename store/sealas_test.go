package store

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// TestSealAs: an object created under one name and sealed under another
// is found, with its bytes and the seal's descriptor, under the new name
// only; waiters of the new name wake; a taken name is EXISTS and leaves the
// object unsealed under its own name; bundles are refused.
func TestSealAs(t *testing.T) {
	s := newTestStore(t, Config{})
	w, r, q := connect(t, s, 1000), connect(t, s, 1000), connect(t, s, 1000)
	p, err := w.ss.createTyped(".ahead-1", 5000, "", false, &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{5000}})
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(5000)
	copy(w.mapping(p), data)
	woke := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		p, err := q.ss.get(ctx, "final", true)
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
	if _, err := w.ss.create(".ahead-2", 100, "", false); err != nil {
		t.Fatal(err)
	}
	if err := w.ss.sealAs(".ahead-2", "final", nil); !errors.Is(err, ErrExists) {
		t.Fatalf("sealing under a taken name: %v, want EXISTS", err)
	}
	if err := w.ss.sealAs(".ahead-2", "final2", &storev1.TensorDesc{Dtype: "float32", Shape: []int64{1000}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a descriptor larger than the object: %v, want INVALID", err)
	}
	if err := w.ss.abort(".ahead-2"); err != nil {
		t.Fatalf("the draft after a refused rename: %v", err)
	}
	// Only the creator's drafts.
	if _, err := w.ss.create(".ahead-3", 100, "", false); err != nil {
		t.Fatal(err)
	}
	if err := r.ss.sealAs(".ahead-3", "stolen", nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("another connection sealing the draft: %v, want NOT_FOUND", err)
	}
	if err := w.ss.sealAs("final", "again", nil); !errors.Is(err, ErrSealed) {
		t.Fatalf("renaming a sealed object: %v, want SEALED", err)
	}
}
