#!/usr/bin/env bash
# GKE Standard cluster for ray-cluster.gke-tcpx.yaml and ray-job.gke.yaml: a CPU pool (operator,
# Ray head, CPU workers) and an a3-highgpu-8g pool (8x H100) with GPUDirect-TCPX: multi-networking
# on the four GPU VPCs that cluster/README.md ("GCP") creates, the 16 local SSDs as the kubelet's
# ephemeral storage, Google's TCPX installer and NRI device injector, and Workload Identity for
# the `raypack` Kubernetes ServiceAccount (cluster/service-account.yaml).
#   PROJECT=my-gcp-project REGION=us-central1 ZONE=us-central1-a cluster/gke-cluster.sh
# Needs gcloud (authenticated, roles/container.admin and roles/iam.serviceAccountAdmin on the
# project), kubectl. Each step is one command; re-running a step that already happened fails at
# that step: run the remaining ones by hand.
set -euo pipefail
PROJECT=${PROJECT:?set PROJECT}
REGION=${REGION:-us-central1}
ZONE=${ZONE:-us-central1-a}          # a zone with a3-highgpu-8g capacity
CLUSTER=${CLUSTER:-raypack}
GPU_NODES_MAX=${GPU_NODES_MAX:-4}
# Google's TCPX manifests (GoogleCloudPlatform/container-engine-accelerators, gpudirect-tcpx/);
# pin the commit you have reviewed.
CEA=${CEA:-https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master}

gcloud config set project "$PROJECT"
# The default pool holds the operator, the Ray head and the CPU workers (cpu: 30, memory: 120Gi
# each): n2-highmem-32, since GKE reserves ~9 GB of an n2-standard-32's 128 GB and the rest
# (~110 GiB) is less than a CPU worker asks.
gcloud container clusters create "$CLUSTER" --location="$ZONE" \
  --network=raypack --subnetwork=raypack-primary \
  --enable-dataplane-v2 --enable-ip-alias --enable-multi-networking \
  --workload-pool="$PROJECT.svc.id.goog" \
  --enable-private-nodes --master-ipv4-cidr=172.16.0.0/28 \
  --machine-type=n2-highmem-32 --disk-size=300 --num-nodes=1 --enable-autoscaling --min-nodes=1 --max-nodes=9 \
  --node-labels=raypack/pool=cpu
gcloud container clusters get-credentials "$CLUSTER" --location="$ZONE"

# The GPU networks as Kubernetes Network objects vpc1..vpc4 (what the GPU pods' annotations name).
for i in 1 2 3 4; do
kubectl apply -f - <<YAML
apiVersion: networking.gke.io/v1
kind: GKENetworkParamSet
metadata: {name: vpc$i}
spec: {vpc: raypack-gpu-$i, vpcSubnet: raypack-gpu-$i, deviceMode: NetDevice}
---
apiVersion: networking.gke.io/v1
kind: Network
metadata: {name: vpc$i}
spec:
  type: Device
  parametersRef: {group: networking.gke.io, kind: GKENetworkParamSet, name: vpc$i}
YAML
done

gcloud container node-pools create a3 --cluster="$CLUSTER" --location="$ZONE" --node-locations="$ZONE" \
  --machine-type=a3-highgpu-8g \
  --accelerator=type=nvidia-h100-80gb,count=8,gpu-driver-version=latest \
  --ephemeral-storage-local-ssd=count=16 \
  --additional-node-network=network=raypack-gpu-1,subnetwork=raypack-gpu-1 \
  --additional-node-network=network=raypack-gpu-2,subnetwork=raypack-gpu-2 \
  --additional-node-network=network=raypack-gpu-3,subnetwork=raypack-gpu-3 \
  --additional-node-network=network=raypack-gpu-4,subnetwork=raypack-gpu-4 \
  --enable-gvnic --placement-type=COMPACT \
  --num-nodes=0 --enable-autoscaling --min-nodes=0 --max-nodes="$GPU_NODES_MAX" \
  --workload-metadata=GKE_METADATA --host-maintenance-interval=PERIODIC
# For a reservation: add --reservation-affinity=specific --reservation=raypack-a3
# (cluster/reservations.yaml, gcp_reservation).

# TCPX on the GPU nodes: the NCCL plugin installer and the NRI device injector (DaemonSets).
kubectl apply -f "$CEA/gpudirect-tcpx/nccl-tcpx-installer.yaml"
kubectl apply -f "$CEA/nri_device_injector/nri-device-injector.yaml"

# Workload Identity: the Kubernetes account default/raypack acts as raypack-nodes (GCS, Artifact
# Registry), named by the annotation in cluster/service-account.yaml.
gcloud iam service-accounts add-iam-policy-binding "raypack-nodes@$PROJECT.iam.gserviceaccount.com" \
  --role=roles/iam.workloadIdentityUser --member="serviceAccount:$PROJECT.svc.id.goog[default/raypack]"
echo "gke-cluster.sh: done; next: cluster/README.md, 'Kubernetes'"
