package store

import (
	"context"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/bundle"
)

// nopCluster is a ClusterHook that publishes everything at once.
type nopCluster struct{}

func (nopCluster) Fetch(context.Context, uint32, uint32, string, ClusterGet) error {
	return ErrNotFound
}
func (nopCluster) FetchTensors(context.Context, uint32, uint32, string, ClusterGet) (string, error) {
	return "", ErrNotFound
}
func (nopCluster) Sealed(context.Context, ClusterObject) (string, error) { return "id-1", nil }
func (nopCluster) Deleted(ClusterObject)                                 {}
func (nopCluster) Dropped(ClusterObject)                                 {}
func (nopCluster) MayEvict(_ context.Context, objs []ClusterObject) []bool {
	return make([]bool, len(objs))
}

// A replica of a GPU bundle is made on the daemon's GPU with its manifest,
// handed to the cluster side as GPU memory, sealed as a bundle, and read
// back by the cluster side (LeaseCluster) at the same device address.
func TestClusterReplicaOfGPUBundle(t *testing.T) {
	s, _ := newFakeCUDAStore(t, Config{Capacity: 1 << 30, Cluster: nopCluster{}})
	specs := []bundle.Spec{{Name: "a", DType: "BF16", Shape: []int64{3, 5}}, {Name: "b", DType: "F32", Shape: []int64{1 << 20}}}
	man, size, err := bundle.Layout(specs, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	f, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "model", Size: size, GPU: true, ID: "id-r",
		Version: 4, Shards: 1, Manifest: man.Marshal()})
	if err != nil {
		t.Fatal(err)
	}
	if f.GPU == nil || f.File != nil {
		t.Fatalf("replica of a GPU bundle: GPU %+v, file %v; want GPU memory", f.GPU, f.File)
	}
	at := f.GPU.Ptr
	if at < cudaipc.DevicePtr(1<<32) || f.Size != size {
		t.Fatalf("replica at %#x, %d bytes", uint64(at), f.Size)
	}
	if err := f.Seal(); err != nil {
		t.Fatal(err)
	}
	f.Release()
	if !s.Replicas().Has(1000, "model", 4, 0) {
		t.Fatal("the sealed replica is not a cluster object here")
	}
	l, err := s.Replicas().Lease(1000, "model", 4, 0, "")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if l.GPU == nil || l.GPU.Ptr != at || l.File != nil {
		t.Fatalf("cluster read of the replica: %+v, want GPU memory at %#x", l.GPU, uint64(at))
	}
	// A partial replica (slice) of the GPU bundle lands on the GPU too,
	// with its manifest.
	sman, ssize, err := bundle.Layout(specs[:1], 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	name, sf, err := s.Replicas().CreateSlice(ClusterSlice{Of: ClusterObject{Owner: 1000, Name: "model", GPU: true, ID: "id-r", Version: 4, Shards: 1},
		Key: "a", Size: ssize, Manifest: sman.Marshal()})
	if err != nil {
		t.Fatal(err)
	}
	if sf.GPU == nil || sf.File != nil {
		t.Fatalf("slice of a GPU bundle: GPU %+v, file %v; want GPU memory", sf.GPU, sf.File)
	}
	if err := sf.Seal(); err != nil {
		t.Fatalf("seal of the slice %q: %v", name, err)
	}
	sf.Release()
	// A host replica still comes as a file.
	h, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "plain", Size: 4096, ID: "id-h"})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Release()
	if h.GPU != nil || h.File == nil {
		t.Fatalf("host replica: GPU %+v, file %v", h.GPU, h.File)
	}
	h.File.Close()
}
