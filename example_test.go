package cudaipc_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/cudaipc/cudaipc"
)

// The exporter allocates, fills and exports a sub-buffer; the region goes to
// the other process as JSON.
func ExampleBuffer_Export() {
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		log.Fatal(err)
	}
	buf, err := dev.Alloc(64 << 20)
	if err != nil {
		log.Fatal(err)
	}
	defer buf.Free() // only after every importer has closed its mappings
	if err := buf.Memset(0x2a); err != nil {
		log.Fatal(err)
	}
	r, err := buf.Export(4096, 1<<20)
	if err != nil {
		log.Fatal(err)
	}
	if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
		log.Fatal(err)
	}
}

// The importer decodes the region (which validates it), maps it through the
// cache and reads it.
func ExampleImport() {
	var r cudaipc.Region
	if err := json.NewDecoder(os.Stdin).Decode(&r); err != nil {
		log.Fatal(err) // a *cudaipc.RegionError says which field is wrong
	}
	m, err := cudaipc.Import(r)
	switch {
	case errors.Is(err, cudaipc.ErrOtherPIDNamespace):
		log.Fatal(err) // another container: use the store daemon instead
	case err != nil:
		log.Fatal(err)
	}
	defer m.Close()
	head := make([]byte, 16)
	if _, err := m.ReadAt(head, 0); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d bytes on %s, starting %x\n", m.Size(), m.Device(), head)
}

// The producer signals after its writes; the consumer's stream waits before
// its reads. The descriptor travels like a region.
func ExampleRemoteEvent_Wait() {
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		log.Fatal(err)
	}
	// Producer.
	ev, err := dev.NewIPCEvent()
	if err != nil {
		log.Fatal(err)
	}
	defer ev.Close()
	desc, err := ev.Export()
	if err != nil {
		log.Fatal(err)
	}
	producer, err := dev.NewStream()
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()
	// ... queue writes on producer ...
	if err := ev.Signal(producer); err != nil {
		log.Fatal(err)
	}

	// Consumer (normally another process, which received desc).
	remote, err := cudaipc.ImportEvent(desc)
	if err != nil {
		log.Fatal(err)
	}
	defer remote.Close()
	consumer, err := dev.NewStream()
	if err != nil {
		log.Fatal(err)
	}
	defer consumer.Close()
	if err := remote.Wait(consumer); err != nil {
		log.Fatal(err)
	}
	// ... queue reads on consumer: they run after the producer's writes ...
}

// Regions validate on decode, without a GPU.
func ExampleDecodeRegion() {
	_, err := cudaipc.DecodeRegion([]byte(`{"version":1,"kind":"cuda-ipc","size":0}`))
	var re *cudaipc.RegionError
	fmt.Println(errors.As(err, &re), re.Field)
	// Output: true handle
}
